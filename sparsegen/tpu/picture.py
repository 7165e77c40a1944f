"""`sparsegen plan --png`: the block pattern, the grid's traversal and where copies happen,
drawn the way the tutorial's figures show them. Needs matplotlib (the `viz` extra)."""

from __future__ import annotations

import numpy as np

from ..callconv import operand_indices
from .simulate import Report


def draw(report: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    sim, plan = report.sim, report.plan
    fig = plt.figure(figsize=(15, 5.2), dpi=110)
    grid = fig.add_gridspec(1, 3, width_ratios=[1, 1, 1.6])
    fig.suptitle(f"{plan.name}: pattern {report.pattern}, grid {sim.grid}, {sim.block_products} of "
                 f"{report.dense.block_products} block products, {sim.wasted_copies} wasted copies")

    ax = fig.add_subplot(grid[0])
    sparse = next((o for o in plan.kernel.operands if o.sparsity in ("coo", "mask")), None)
    if report.blocks is not None:
        if sparse.sparsity == "mask":
            ax.imshow(report.blocks, cmap=ListedColormap(["#f4f4f4", "#f0a35e", "#3b75af"]), vmin=0, vmax=2)
            ax.set_title(f"{sparse.name} blocks: empty / partial / full")
        else:
            ax.imshow(report.blocks, cmap="Blues", vmin=0)
            ax.set_title(f"{sparse.name}: stored blocks per block")
        ax.set_xlabel(f"block along {operand_indices(plan.kernel, sparse)[1]}")
        ax.set_ylabel(f"block along {operand_indices(plan.kernel, sparse)[0]}")
    else:
        ax.text(0.5, 0.5, "no 2-D sparse operand", ha="center", va="center")
        ax.set_axis_off()

    ax = fig.add_subplot(grid[1])
    out = sim.trace.get("out")
    if out is not None and out.shape[0] >= 2 and sim.steps:
        rows, cols = out[-2], out[-1]
        change = np.ones(len(rows), bool)
        change[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
        r, c = rows[change], cols[change]
        ax.plot(c, r, color="#999999", linewidth=0.8, zorder=1)
        ax.scatter(c, r, c=np.arange(len(r)), cmap="viridis", s=18, zorder=2)
        ax.invert_yaxis()
        ax.set_aspect("equal")
        ax.set_title("output blocks in visit order (dark: first)")
        ax.set_xlabel("output block column")
        ax.set_ylabel("output block row")
    else:
        ax.set_axis_off()

    ax = fig.add_subplot(grid[2])
    labels = []
    steps = np.arange(sim.steps)
    lanes = [("compute", sim.trace.get("compute"), "#2a9d8f")]
    for name in sim.traffic:
        lanes.append((f"copy {name}", sim.trace.get(f"copy:{name}"), "#3b75af"))
    for y, (label, mask, color) in enumerate(lanes):
        if mask is None:
            continue
        ax.vlines(steps[mask], y - 0.35, y + 0.35, color=color, linewidth=0.8)
        labels.append(label)
        name = label.removeprefix("copy ")
        wasted = sim.trace.get(f"wasted:{name}")
        if label.startswith("copy") and wasted is not None and wasted.any():
            ax.vlines(steps[wasted], y - 0.35, y + 0.35, color="#d62728", linewidth=1.2)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("grid step (in order)")
    ax.set_title("copies HBM->VMEM per operand (red: wasted) and compute steps")
    ax.set_xlim(-0.5, max(sim.steps, 1) - 0.5)
    fig.tight_layout()
    fig.savefig(path, format="png")  # whatever the file is called
    plt.close(fig)
