"""The reporting half of `kvtier bench datapath` (the measurement is in datapath.py): the figures and ratios
read off each chunk size's phases, the result's summary (figure, baseline, ratio, headline ratios), the text
table and the plot."""

from __future__ import annotations

import math
from typing import Any

from kvtier.server.bench import common as bc
from kvtier.server.bench.datapath import MODES, MiB


def summary(rows: dict[str, Any]) -> dict[str, Any]:
    """The result of the run from the rows of its chunk sizes: the figure and baseline of the largest chunk."""
    biggest = rows[max(rows, key=lambda k: rows[k]["chunk_bytes"])]
    result = {
        "bench": "datapath",
        "machine": bc.machine(),
        "sizes": rows,
        "figure": {"name": "store copy GB/s (median per request), warm pages, per-block pieces, largest chunk",
                   "value": biggest["path"]["store_warm_blocks"]["copy_gbps_median"]},
        "baseline": {"name": "raw np.copyto GB/s of the same pieces between two preallocated buffers, "
                             "interleaved with the stores (median)",
                     "value": biggest["raw"]["memcpy_blocks"]["copy_gbps_median"]},
    }
    result["ratio"] = result["figure"]["value"] / result["baseline"]["value"]
    fb = figures(biggest, "blocks")
    result["headline"] = {
        "store copy warm / raw memcpy (same pieces)": fb["store copy, warm"] / fb["raw memcpy"],
        "store copy warm / raw into warm shm (same pieces)": fb["store copy, warm"] / fb["raw into shm, warm"],
        "retrieve copy warm / raw memcpy (same pieces)": fb["retrieve copy, warm"] / fb["raw memcpy"],
        "retrieve copy warm / raw out of warm shm (same pieces)":
            fb["retrieve copy, warm"] / fb["raw out of shm, warm"],
        "store copy cold / raw into cold shm (same pieces)":
            fb["store copy, cold pages"] / fb["raw into shm, cold"],
    }
    return result


def _v(summary: dict[str, Any], warm: bool, key: str = "copy") -> float:
    """Warm figures are medians of per-request rates; cold ones (one pass each) are byte-weighted."""
    if key == "e2e":
        return summary["e2e_gbps"]
    return summary["copy_gbps_median"] if warm else summary["copy_gbps"]


def figures(row: dict[str, Any], mode: str) -> dict[str, float]:
    p, r = row["path"], row["raw"]
    return {
        "store copy, cold pages": _v(p[f"store_cold_{mode}"], False),
        "store e2e, cold pages": _v(p[f"store_cold_{mode}"], False, "e2e"),
        "store copy, warm": _v(p[f"store_warm_{mode}"], True),
        "store e2e, warm": _v(p[f"store_warm_{mode}"], True, "e2e"),
        "retrieve copy, warm": _v(p[f"retrieve_warm_{mode}"], True),
        "retrieve e2e, warm": _v(p[f"retrieve_warm_{mode}"], True, "e2e"),
        "retrieve copy, new mapping": _v(p[f"retrieve_fresh_map_{mode}"], False),
        "raw memcpy": _v(r[f"memcpy_{mode}"], True),
        "raw into shm, cold": _v(r[f"shm_write_cold_{mode}"], False),
        "raw into shm, warm": _v(r[f"shm_write_warm_{mode}"], True),
        "raw out of shm, warm": _v(r[f"shm_read_warm_{mode}"], True),
        "raw out of shm, new mapping": _v(r[f"shm_read_fresh_map_{mode}"], False),
    }


RATIOS = (
    ("store copy warm / memcpy", "store copy, warm", "raw memcpy"),
    ("store copy warm / raw into shm warm", "store copy, warm", "raw into shm, warm"),
    ("store e2e warm / memcpy", "store e2e, warm", "raw memcpy"),
    ("store copy cold / raw into shm cold", "store copy, cold pages", "raw into shm, cold"),
    ("store e2e cold / raw into shm cold", "store e2e, cold pages", "raw into shm, cold"),
    ("retrieve copy warm / memcpy", "retrieve copy, warm", "raw memcpy"),
    ("retrieve copy warm / raw out of shm warm", "retrieve copy, warm", "raw out of shm, warm"),
    ("retrieve e2e warm / memcpy", "retrieve e2e, warm", "raw memcpy"),
    ("retrieve new mapping / raw new mapping", "retrieve copy, new mapping", "raw out of shm, new mapping"),
)


def ratios(path: dict[str, Any], raw: dict[str, Any]) -> dict[str, float]:
    out = {}
    for mode in MODES:
        f = figures({"path": path, "raw": raw}, mode)
        for name, a, b in RATIOS:
            out[f"{mode}: {name}"] = f[a] / f[b] if f[b] else math.nan
    return out


def text(result: dict[str, Any]) -> str:
    lines = ["kvtier bench datapath: GB/s (1e9 B/s). copy = the memcpy inside the callbacks, e2e = the whole "
             "store()/retrieve() call incl. key hashing and RPCs.",
             "warm = median of per-request rates; cold / new mapping = one pass, byte-weighted."]
    for size, row in sorted(result["sizes"].items(), key=lambda kv: kv[1]["chunk_bytes"]):
        lines.append(f"\n== {size} MiB chunks: {row['chunks_per_request']} per request, 'blocks' = pieces of "
                     f"{row['block_bytes'] // 1024} KiB, L1 {row['l1_bytes'] // MiB} MiB, "
                     f"{row['resident_prompts_read']} resident prompts read back")
        fc, fb = figures(row, "chunk"), figures(row, "blocks")
        lines.append(f"  {'':34}{'one copy/chunk':>15}{'per-block':>11}")
        for name in fc:
            lines.append(f"  {name:34}{fc[name]:15.2f}{fb[name]:11.2f}")
        runs = row["path"]["store_warm_chunk"]["runs_per_chunk"]
        lines.append(f"  page runs per chunk (warm stores): {runs:.2f}")
        lines.append("  ratios:")
        for name, _, _ in RATIOS:
            lines.append(f"  {name:44}{row['ratios']['chunk: ' + name]:15.2f}x{row['ratios']['blocks: ' + name]:10.2f}x")
    lines.append(f"\nFIGURE   {result['figure']['name']}: {result['figure']['value']:.2f} GB/s")
    lines.append(f"BASELINE {result['baseline']['name']}: {result['baseline']['value']:.2f} GB/s")
    lines.append(f"RATIO    {result['ratio']:.2f}x (goal >= 0.9x)")
    lines.append("largest chunk, per-block pieces:")
    for name, v in result["headline"].items():
        lines.append(f"  {name:58}{v:6.2f}x")
    return "\n".join(lines)


def plot(rows: dict[str, Any], path: str) -> None:
    plt = bc.plotting(path)
    if plt is None:
        return
    sizes = sorted(rows, key=lambda k: rows[k]["chunk_bytes"])
    names = ["store copy, warm", "raw into shm, warm", "raw memcpy", "store e2e, warm", "retrieve copy, warm",
             "raw out of shm, warm", "retrieve e2e, warm", "store copy, cold pages", "raw into shm, cold"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    width = 0.85 / len(names)
    for ax, mode in zip(axes, MODES, strict=True):
        for k, name in enumerate(names):
            xs = [i + (k - len(names) / 2 + 0.5) * width for i in range(len(sizes))]
            ax.bar(xs, [figures(rows[s], mode)[name] for s in sizes], width, label=name,
                   hatch="//" if name.startswith("raw") else None)
        ax.set_xticks(range(len(sizes)), [f"{s} MiB" for s in sizes])
        ax.set_title("one copy per chunk" if mode == "chunk" else f"per-block pieces "
                     f"({rows[sizes[0]]['block_bytes'] // 1024} KiB)")
        ax.set_xlabel("chunk size (256 tokens)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="upper right")
    fig.suptitle("kvtier copy path vs raw np.copyto of the same bytes, same run (hatched = raw)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
