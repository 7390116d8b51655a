#!/usr/bin/env python3
"""abidiff gate for the rlhost ABI (abigail-tools).

Baselines live in abi/abidiff/<major>.<minor>/<library>.abixml, written by `abidw` for the
libraries that carry the ABI: libabi_anchor.so (one exported function per public ABI type, so the
whole type graph is reachable; built from abi/tools/anchor.c) and librlhost.so (the embedding API,
host/include/rlhost/host.h).

  baseline   write the baselines of the current ABI version (after a version bump)
  check      compare every library against the baselines of the current major:
               - the baseline of the current version: any change fails (abidiff exit bit 4
                 "ABI change" or bit 8 "incompatible change") -- a change needs a new version;
               - baselines of older minors: incompatible changes fail (exit bit 8, removed
                 functions, and layout breaks abidiff reports as mere changes: a data member
                 deleted, moved to another offset or retyped, a type that shrank); compatible
                 changes (appended members, added functions) are what a minor is for.
           A missing abidiff/abidw is a skip (exit 77) with the reason, never a pass.

Libraries are given as NAME=PATH[:HEADERS_DIR...]. Standard library only.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layout  # noqa: E402  (same folder)

ABIDIFF_ERROR = 1
ABIDIFF_USAGE_ERROR = 2
ABIDIFF_ABI_CHANGE = 4
ABIDIFF_ABI_INCOMPATIBLE_CHANGE = 8
SKIP = 77

# Leaf-mode abidiff report lines that mean a layout break even when abidiff only sets bit 4.
_BREAKS = [
    (re.compile(r"offset changed from"), "a member moved"),
    (re.compile(r"data members? deletions?"), "a member was deleted"),
    (re.compile(r"^\s*type '.*' of '.*' changed"), "a member changed type"),
    (re.compile(r"alignment changed"), "an alignment changed"),
    (re.compile(r"\b([1-9]\d*) Removed\b"), "a function or variable was removed"),
]
_SIZE = re.compile(r"type size changed from (\d+) to (\d+)")


def abi_version(include_dir: Path) -> tuple[int, int]:
    info = layout.scan_header("rlhost/core.h", include_dir / "rlhost" / "core.h")
    vals = {d.name: d.body for d in info.defines}
    try:
        return int(vals["RLH_ABI_VERSION_MAJOR"]), int(vals["RLH_ABI_VERSION_MINOR"])
    except (KeyError, ValueError):
        raise SystemExit(f"error: RLH_ABI_VERSION_MAJOR/MINOR not found in {include_dir}/rlhost/core.h")


def parse_libs(specs: list[str]) -> dict[str, tuple[Path, list[Path]]]:
    libs = {}
    for s in specs:
        name, _, rest = s.partition("=")
        parts = rest.split(":")
        if not name or not parts[0]:
            raise SystemExit(f"error: --lib wants NAME=PATH[:HEADERS_DIR...], got {s!r}")
        libs[name] = (Path(parts[0]), [Path(p) for p in parts[1:] if p])
    return libs


def baseline_dirs(root: Path) -> list[tuple[tuple[int, int], Path]]:
    out = []
    for d in root.glob("*"):
        m = re.fullmatch(r"(\d+)\.(\d+)", d.name)
        if d.is_dir() and m:
            out.append(((int(m.group(1)), int(m.group(2))), d))
    return sorted(out)


def classify(report: str) -> list[str]:
    why = []
    for rx, what in _BREAKS:
        for line in report.splitlines():
            if rx.search(line):
                why.append(f"{what}: {line.strip()}")
                break
    for m in _SIZE.finditer(report):
        if int(m.group(2)) < int(m.group(1)):
            why.append(f"a type shrank: {m.group(0)}")
            break
    return why


def cmd_baseline(args) -> int:
    abidw = args.abidw if args.abidw and not args.abidw.endswith("NOTFOUND") else shutil.which("abidw")
    if not abidw:
        print("SKIP: abidw (abigail-tools) not found; cannot write the abidiff baseline")
        return SKIP
    ver = abi_version(Path(args.include))
    out_dir = Path(args.baseline_dir) / f"{ver[0]}.{ver[1]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, (lib, headers) in parse_libs(args.lib).items():
        if not lib.exists():
            print(f"error: {lib} does not exist (build it first)", file=sys.stderr)
            return 1
        out = out_dir / f"{name}.abixml"
        # Only what the library exports and the types its public headers declare: small, stable
        # baselines that do not churn with the library's internals.
        cmd = [abidw, "--no-corpus-path", "--no-comp-dir-path", "--short-locs", "--exported-interfaces-only",
               "--drop-private-types", "--out-file", str(out)]
        for h in headers:
            cmd += ["--headers-dir", str(h)]
        subprocess.run(cmd + [str(lib)], check=True)
        print(f"wrote {out}")
    return 0


def cmd_check(args) -> int:
    abidiff = args.abidiff if args.abidiff and not args.abidiff.endswith("NOTFOUND") else None
    if not abidiff:
        print("SKIP: abidiff (abigail-tools) not found; the abidiff ABI gate did not run. "
              "Install abigail-tools (Debian package) to run it.")
        return SKIP
    ver = abi_version(Path(args.include))
    libs = parse_libs(args.lib)
    root = Path(args.baseline_dir)
    errs: list[str] = []
    ran = 0
    bases = [(v, d) for v, d in baseline_dirs(root) if v[0] == ver[0]]
    for v, d in bases:
        if v > ver:
            errs.append(f"baseline {d} is newer than the headers' ABI {ver[0]}.{ver[1]}")
    if not any(v == ver for v, _ in bases):
        errs.append(f"no abidiff baseline for ABI {ver[0]}.{ver[1]} in {root}: after a version bump, "
                    f"run `cmake --build <build> --target abi_baseline` and commit {root}/{ver[0]}.{ver[1]}/")
    for v, d in bases:
        if v > ver:
            continue
        vs = f"{v[0]}.{v[1]}"
        for f in sorted(d.glob("*.abixml")):
            if f.stem not in libs:
                errs.append(f"{f} has no library to compare with (pass --lib {f.stem}=PATH; is its target built?)")
        for name, (lib, headers) in libs.items():
            base = d / f"{name}.abixml"
            if not base.exists():
                if v == ver:
                    errs.append(f"{name}: no baseline {base}: run the abi_baseline target and commit it")
                continue
            if not lib.exists():
                errs.append(f"{name}: {lib} does not exist (build it first)")
                continue
            cmd = [abidiff, "--leaf-changes-only", "--no-default-suppression"]
            for h in headers:
                cmd += ["--headers-dir2", str(h)]
            cmd += [str(base), str(lib)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            ran += 1
            report = (r.stdout + r.stderr).strip()
            if r.returncode & (ABIDIFF_ERROR | ABIDIFF_USAGE_ERROR):
                errs.append(f"{name}: abidiff failed (exit {r.returncode}): {' '.join(cmd)}\n{report}")
                continue
            breaks = classify(report)
            incompatible = bool(r.returncode & ABIDIFF_ABI_INCOMPATIBLE_CHANGE) or bool(breaks)
            changed = bool(r.returncode & (ABIDIFF_ABI_CHANGE | ABIDIFF_ABI_INCOMPATIBLE_CHANGE))
            tag = f"{name} vs baseline {vs} (abidiff exit {r.returncode})"
            if incompatible:
                why = "; ".join(breaks) if breaks else "abidiff reports an incompatible change"
                errs.append(f"{tag}: INCOMPATIBLE ABI change ({why}). Within major {ver[0]} fields and "
                            f"slots may only be appended; a break needs a new major.\n{report}")
            elif changed and v == ver:
                errs.append(f"{tag}: the ABI changed but the version is still {vs}. Bump "
                            f"RLH_ABI_VERSION_MINOR (and the interface versions), regenerate the golden "
                            f"layout and this baseline (docs/abi.md, 'Changing the ABI').\n{report}")
            elif changed:
                print(f"{tag}: compatible changes since {vs} (allowed: the version moved on):\n{report}\n")
            else:
                print(f"{tag}: no change")
    if errs:
        print(f"abidiff gate FAILED ({len(errs)} problem(s)):", file=sys.stderr)
        for e in errs:
            print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print(f"abidiff gate passed: ABI {ver[0]}.{ver[1]}, {ran} comparison(s)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for n in ("baseline", "check"):
        p = sub.add_parser(n)
        p.add_argument("--include", required=True, help="include root holding rlhost/core.h (ABI version)")
        p.add_argument("--baseline-dir", required=True, help="abi/abidiff")
        p.add_argument("--lib", action="append", default=[], help="NAME=PATH[:HEADERS_DIR...]")
        p.add_argument("--abidw" if n == "baseline" else "--abidiff", default=None)
    args = ap.parse_args(argv)
    if not args.lib:
        ap.error("at least one --lib")
    return cmd_baseline(args) if args.cmd == "baseline" else cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
