"""What every target's walks share above the schedule: the jax.numpy reference of the row walk
(`reference`), which gradients the flash backward derives (`flash_gradients`), and the row and
paged emitters' host side (`row`, `paged`). Backend-neutral: tpu/ and gpu/ import these, never
each other."""
