"""An old commit against this tree, interleaved: kvtier bench lookup, datapath and l2 (ratios new/old), or the
benches named (`node`, the daemon's CPU per operation under `kvtier bench node`, needs an old commit that has it).

    .venv/bin/python scripts/compare_commits.py OLD_REV [ROUNDS] [BENCH,BENCH,...]

The old commit is checked out as a git worktree under $TMPDIR and run from the same venv with PYTHONPATH
pointing at its four packages (their servers inherit it); each round runs every bench for both, alternating
which goes first. Prints one line per figure: the runs of each and the ratio of their medians.
"""
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PY = sys.executable
OLD = pathlib.Path(tempfile.gettempdir()) / "kvtier-compare"


def prepare(rev: str) -> str:
    """A worktree of `rev` and a package root mapping kvtier.<part> to its folders; returns the root."""
    tree, pkg = OLD / "tree", OLD / "pkg" / "kvtier"
    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True, capture_output=True)
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").touch()
    for part in ("server", "connector", "shm", "admin_api"):
        link = pkg / part
        if link.is_symlink():
            link.unlink()
        link.symlink_to(tree / part)
    return str(pkg.parent)
BENCHES = {
    "lookup": ["bench", "lookup", "--iters", "500", "--max-entries", "100000", "--no-idle", "--json"],
    "datapath": ["bench", "datapath", "--json"],
    "l2": ["bench", "l2", "--json"],
}
OPTIONAL = {"node": ["bench", "node", "--clients", "1,4", "--seconds", "5", "--echo-seconds", "2", "--json"]}
def run(version, args):
    env = dict(os.environ)
    if version == "old":
        env["PYTHONPATH"] = OLD_PKG
    else:
        env.pop("PYTHONPATH", None)
    out = subprocess.run([PY, "-m", "kvtier.server.cli", *args], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir(), timeout=900)
    if out.returncode:
        raise SystemExit(f"{version} {args[1]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)
def figures(name, d):
    if name == "lookup":
        return {f"lookup p50 ratio to echo @{lv['entries']}": lv["ratio_p50"] for lv in d["levels"]} | {
            f"lookup p50 us @{lv['entries']}": lv["latency"]["kvtier_lookup"]["p50_us"] for lv in d["levels"]}
    if name == "node":
        return {f"node daemon CPU us/op @N={row['clients']}": row["kvtier"]["cpu_us_per_op"] for row in d["rows"]} | {
            f"node ops/s @N={row['clients']}": row["kvtier"]["ops_per_s"] for row in d["rows"]}
    if name == "datapath":
        return {f"datapath {k}": v for k, v in d["headline"].items()} | {"datapath store GB/s (largest chunk)": d["figure"]["value"]}
    return {f"l2 ratio {k}": v for k, v in d["ratios"].items()} | {
        "l2 promote lookup p50 us": d["lookup"]["promote_lookup"]["p50_us"],
        "l2 L1-hit lookup p50 us": d["lookup"]["l1_hit_lookup"]["p50_us"]}
OLD_PKG = prepare(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
if len(sys.argv) > 3:
    BENCHES = {name: {**BENCHES, **OPTIONAL}[name] for name in sys.argv[3].split(",")}
results = {"old": {}, "new": {}}
t0 = time.time()
for r in range(rounds):
    for name, args in BENCHES.items():
        for version in (("old", "new") if r % 2 == 0 else ("new", "old")):
            for k, v in figures(name, run(version, args)).items():
                results[version].setdefault(k, []).append(v)
            print(f"round {r} {name} {version} done {time.time()-t0:.0f}s", file=sys.stderr, flush=True)
print(f"{'figure':<70} {'old (runs)':>24} {'new (runs)':>24} {'new/old':>8}")
for k in results["old"]:
    o, n = results["old"][k], results["new"][k]
    mo, mn = statistics.median(o), statistics.median(n)
    print(f"{k:<70} {'/'.join(f'{x:.3g}' for x in o):>24} {'/'.join(f'{x:.3g}' for x in n):>24} {mn/mo if mo else 0:>8.3f}")
