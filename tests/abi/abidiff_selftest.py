#!/usr/bin/env python3
"""Self-tests of the abidiff gate (abi/tools/abicheck.py): each scenario copies the headers and
the committed baselines into a temporary folder, changes the headers, rebuilds libabi_anchor.so
from abi/tools/anchor.c against them (-g -Og, like the real target) and checks that the gate
fails (or, for the controls, passes) for the stated reason.

    abidiff_selftest.py <scenario> --abi-dir abi --cc cc --abidw abidw --abidiff abidiff
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = 77


class Fail(Exception):
    pass


class Setup:
    def __init__(self, a, tmp: Path):
        self.src = Path(a.abi_dir).resolve()
        self.tmp = tmp
        self.include = tmp / "include"
        shutil.copytree(self.src / "include", self.include)
        self.baselines = tmp / "abidiff"
        self.baselines.mkdir()
        ver = self.version()
        base = self.src / "abidiff" / f"{ver[0]}.{ver[1]}" / "abi_anchor.abixml"
        if not base.exists():
            raise Fail(f"no committed baseline {base}")
        (self.baselines / f"{ver[0]}.{ver[1]}").mkdir()
        shutil.copyfile(base, self.baselines / f"{ver[0]}.{ver[1]}" / "abi_anchor.abixml")
        self.cc, self.abidw, self.abidiff = a.cc, a.abidw, a.abidiff
        self.lib = tmp / "libabi_anchor.so"

    def hdr(self, name: str) -> Path:
        return self.include / "rlhost" / name

    def edit(self, path: Path, old: str, new: str) -> None:
        text = path.read_text(encoding="utf-8")
        if old not in text:
            raise Fail(f"scenario setup: {old!r} not found in {path}")
        path.write_text(text.replace(old, new, 1), encoding="utf-8")

    def version(self) -> tuple[int, int]:
        t = self.hdr("core.h").read_text(encoding="utf-8")
        return (int(re.search(r"#define RLH_ABI_VERSION_MAJOR (\d+)", t).group(1)),
                int(re.search(r"#define RLH_ABI_VERSION_MINOR (\d+)", t).group(1)))

    def bump(self) -> None:
        ma, mi = self.version()
        self.edit(self.hdr("core.h"), f"#define RLH_ABI_VERSION_MINOR {mi}\n", f"#define RLH_ABI_VERSION_MINOR {mi + 1}\n")

    def build(self) -> None:
        r = subprocess.run([self.cc, "-g", "-Og", "-shared", "-fPIC", "-fvisibility=hidden", "-Wl,-soname,libabi_anchor.so", "-I", str(self.include),
                            str(self.src / "tools" / "anchor.c"), "-o", str(self.lib)], capture_output=True, text=True)
        if r.returncode != 0:
            raise Fail(f"building the anchor failed:\n{r.stderr}")

    def tool(self, cmd: str) -> tuple[int, str]:
        args = [sys.executable, str(self.src / "tools" / "abicheck.py"), cmd, "--include", str(self.include),
                "--baseline-dir", str(self.baselines),
                "--lib", f"abi_anchor={self.lib}:{self.include / 'rlhost'}"]
        args += ["--abidw", self.abidw] if cmd == "baseline" else ["--abidiff", self.abidiff]
        r = subprocess.run(args, capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr


def expect(rc: int, out: str, ok: bool, *needles: str) -> None:
    if ok and rc != 0:
        raise Fail(f"expected the abidiff gate to PASS, it failed (rc {rc}):\n{out}")
    if not ok and rc != 1:
        raise Fail(f"expected the abidiff gate to FAIL (rc 1), got rc {rc}:\n{out}")
    for n in needles:
        if n not in out:
            raise Fail(f"expected {n!r} in the gate's output:\n{out}")


MID_OLD = "  void (*destroy)(rlh_environment* self);\n"
MID_NEW = "  int32_t inserted_in_the_middle;\n" + MID_OLD
END_OLD = "                       rlh_env_result* result);\n} rlh_environment_api;"
END_NEW = ("                       rlh_env_result* result);\n"
           "  rlh_status* (*appended_slot)(rlh_environment* self);\n} rlh_environment_api;")


def scenario(name: str, s: Setup) -> None:
    ma, mi = s.version()
    if name == "unchanged_passes":
        s.build()
        rc, out = s.tool("check")
        expect(rc, out, True, "abidiff gate passed", "no change")
    elif name == "insert_mid_fails":
        s.edit(s.hdr("environment.h"), MID_OLD, MID_NEW)
        s.build()
        rc, out = s.tool("check")
        expect(rc, out, False, "INCOMPATIBLE ABI change", "a member moved", "destroy")
    elif name == "append_same_version_fails":
        s.edit(s.hdr("environment.h"), END_OLD, END_NEW)
        s.build()
        rc, out = s.tool("check")
        expect(rc, out, False, f"the ABI changed but the version is still {ma}.{mi}", "appended_slot")
    elif name == "append_bumped_passes":
        s.edit(s.hdr("environment.h"), END_OLD, END_NEW)
        s.bump()
        s.build()
        rc, out = s.tool("baseline")
        if rc != 0:
            raise Fail(f"abicheck.py baseline failed:\n{out}")
        rc, out = s.tool("check")
        expect(rc, out, True, f"compatible changes since {ma}.{mi}", "appended_slot", "2 comparison(s)")
    elif name == "insert_mid_bumped_fails":
        s.edit(s.hdr("environment.h"), MID_OLD, MID_NEW)
        s.bump()
        s.build()
        s.tool("baseline")
        rc, out = s.tool("check")
        expect(rc, out, False, f"vs baseline {ma}.{mi}", "INCOMPATIBLE ABI change", "a member moved")
    elif name == "removed_slot_bumped_fails":
        s.edit(s.hdr("dataset.h"), "  int64_t (*size)(const rlh_dataset* self);\n", "")
        s.bump()
        s.build()
        s.tool("baseline")
        rc, out = s.tool("check")
        expect(rc, out, False, "INCOMPATIBLE ABI change", "a member was deleted")
    elif name == "bumped_without_baseline_fails":
        s.edit(s.hdr("environment.h"), END_OLD, END_NEW)
        s.bump()
        s.build()
        rc, out = s.tool("check")
        expect(rc, out, False, f"no abidiff baseline for ABI {ma}.{mi + 1}")
    else:
        raise SystemExit(f"unknown scenario {name}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--abi-dir", required=True)
    ap.add_argument("--cc", required=True)
    ap.add_argument("--abidw", required=True)
    ap.add_argument("--abidiff", required=True)
    a = ap.parse_args()
    for t in (a.abidw, a.abidiff):
        if not shutil.which(t):
            print(f"SKIP: {t} not found")
            return SKIP
    with tempfile.TemporaryDirectory(prefix="rlh_abidiff_selftest_") as tmp:
        try:
            scenario(a.scenario, Setup(a, Path(tmp)))
        except Fail as e:
            print(f"SELFTEST FAILED [{a.scenario}]: {e}", file=sys.stderr)
            return 1
    print(f"selftest {a.scenario}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
