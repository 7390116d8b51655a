#!/usr/bin/env python3
"""Self-tests of the ABI layout gate (abi/tools/layout.py): each scenario copies abi/ into a
temporary folder, changes it the way a developer might, runs the gate there and checks that it
fails (or, for the controls, passes) for the stated reason. A gate that cannot fail is no gate.

    layout_selftest.py <scenario> --abi-dir abi [--extra-header host/include/rlhost/host.h]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = 77


class Fail(Exception):
    pass


class Copy:
    """A scratch copy of abi/ (include, layout, frozen, generated tools files, CHANGELOG)."""

    def __init__(self, src: Path, tmp: Path, extra: list[str]):
        self.abi = tmp / "abi"
        self.abi.mkdir()
        for d in ("include", "layout", "frozen"):
            if (src / d).exists():
                shutil.copytree(src / d, self.abi / d)
        (self.abi / "tools").mkdir()
        for f in ("slot_asserts.c", "anchor.c"):
            shutil.copyfile(src / "tools" / f, self.abi / "tools" / f)
        shutil.copyfile(src / "CHANGELOG.md", self.abi / "CHANGELOG.md")
        self.tool = src / "tools" / "layout.py"
        self.extra = extra

    def hdr(self, name: str) -> Path:
        return self.abi / "include" / "rlhost" / name

    def edit(self, path: Path, old: str, new: str, count: int = 1) -> None:
        text = path.read_text(encoding="utf-8")
        if text.count(old) < 1:
            raise Fail(f"scenario setup: {old!r} not found in {path}")
        path.write_text(text.replace(old, new, count), encoding="utf-8")

    def version(self) -> tuple[int, int]:
        t = self.hdr("core.h").read_text(encoding="utf-8")
        return (int(re.search(r"#define RLH_ABI_VERSION_MAJOR (\d+)", t).group(1)),
                int(re.search(r"#define RLH_ABI_VERSION_MINOR (\d+)", t).group(1)))

    def bump(self, iface: str | None = None) -> None:
        """Bumps RLH_ABI_VERSION_MINOR, and RLH_<iface>_API_VERSION_MINOR when given."""
        ma, mi = self.version()
        self.edit(self.hdr("core.h"), f"#define RLH_ABI_VERSION_MINOR {mi}\n",
                  f"#define RLH_ABI_VERSION_MINOR {mi + 1}\n")
        if iface:
            h = self.hdr(f"{iface.lower()}.h")
            m = re.search(rf"#define RLH_{iface}_API_VERSION_MINOR (\d+)\n", h.read_text(encoding="utf-8"))
            self.edit(h, m.group(0), f"#define RLH_{iface}_API_VERSION_MINOR {int(m.group(1)) + 1}\n")

    def run(self, *args: str) -> tuple[int, str]:
        cmd = [sys.executable, str(self.tool), *args, "--abi-dir", str(self.abi)]
        for e in self.extra:
            cmd += ["--extra-header", e]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr

    def check(self) -> tuple[int, str]:
        return self.run("check")

    def write_release(self, changelog: bool = True, force: bool = False) -> str:
        """`layout.py write` (golden, frozen copy, generated files); pastes the CHANGELOG entry."""
        rc, out = self.run("write", *(["--force"] if force else []))
        if rc != 0:
            raise Fail(f"layout.py write failed:\n{out}")
        if changelog:
            m = re.search(r"^(## \d+\.\d+\n.*?- changes: .*?\n)", out, re.S | re.M)
            if not m:
                raise Fail(f"layout.py write printed no CHANGELOG entry:\n{out}")
            cl = self.abi / "CHANGELOG.md"
            text = cl.read_text(encoding="utf-8")
            i = text.index("\n## ")
            cl.write_text(text[:i + 1] + m.group(1) + "\n" + text[i + 1:], encoding="utf-8")
        return out


def expect(rc: int, out: str, ok: bool, *needles: str) -> None:
    if ok and rc != 0:
        raise Fail(f"expected the gate to PASS, it failed (rc {rc}):\n{out}")
    if not ok and rc == 0:
        raise Fail(f"expected the gate to FAIL, it passed:\n{out}")
    if not ok and rc != 1:
        raise Fail(f"expected a gate failure (rc 1), got rc {rc} (a tool error?):\n{out}")
    for n in needles:
        if n not in out:
            raise Fail(f"expected {n!r} in the gate's output:\n{out}")


# A slot inserted in the middle of a table, a slot appended at its end.
MID_OLD = "  void (*destroy)(rlh_environment* self);\n"
MID_NEW = "  int32_t inserted_in_the_middle;\n" + MID_OLD
END_OLD = "                       rlh_env_result* result);\n} rlh_environment_api;"
END_NEW = ("                       rlh_env_result* result);\n"
           "  rlh_status* (*appended_slot)(rlh_environment* self);\n} rlh_environment_api;")


def scenario(name: str, c: Copy) -> None:
    env_h = c.hdr("environment.h")
    ma, mi = c.version()
    if name == "copy_passes":
        rc, out = c.check()
        expect(rc, out, True, "ABI layout check passed")
    elif name == "insert_mid_fails":
        c.edit(env_h, MID_OLD, MID_NEW)
        rc, out = c.check()
        expect(rc, out, False, f"differs from its golden file abi/layout/{ma}.{mi}.txt",
               "+field rlh_environment_api inserted_in_the_middle 16 4 4 int32_t",
               "bump RLH_ABI_VERSION_MINOR")
    elif name == "regen_golden_without_changelog_fails":
        c.edit(env_h, END_OLD, END_NEW)
        c.write_release(changelog=False, force=True)  # the golden alone, regenerated in place
        rc, out = c.check()
        expect(rc, out, False, f"abi/CHANGELOG.md entry {ma}.{mi} records layout sha256",
               "a golden file changed without a new version")
    elif name == "insert_mid_with_bump_fails":
        c.edit(env_h, MID_OLD, MID_NEW)
        c.bump("ENVIRONMENT")
        c.write_release()
        rc, out = c.check()
        expect(rc, out, False, f"{ma}.{mi} -> {ma}.{mi + 1}: rlh_environment_api field #2 was 'destroy'",
               "fields may only be appended at the end within a major version")
    elif name == "append_with_bump_passes":
        c.edit(env_h, END_OLD, END_NEW)
        c.bump("ENVIRONMENT")
        c.write_release()
        rc, out = c.check()
        expect(rc, out, True, f"ABI {ma}.{mi + 1}", "2 golden file(s)" if mi == 1 else "golden file(s)")
        # The regenerated slot asserts pin the new slot and still compile.
        sa = (c.abi / "tools" / "slot_asserts.c").read_text(encoding="utf-8")
        if "RLH_PIN_FIELD(rlh_environment_api, appended_slot, 40, 8); /* since " + f"{ma}.{mi + 1}" not in sa:
            raise Fail("slot_asserts.c does not pin the appended slot:\n" + sa[:2000])
        compile_slot_asserts(c, expect_ok=True)
    elif name == "append_without_iface_bump_fails":
        c.edit(env_h, END_OLD, END_NEW)
        c.bump()  # the ABI minor only
        c.write_release()
        rc, out = c.check()
        expect(rc, out, False, "rlhost/environment.h grew but RLH_ENVIRONMENT_API_VERSION stayed")
    elif name == "append_to_array_element_fails":
        # rlh_env_sample has a struct_size, but score() takes an array of them: growing it
        # changes the stride older readers use.
        c.edit(env_h, "  size_t metadata_len;\n} rlh_env_sample;",
               "  size_t metadata_len;\n  double weight;\n} rlh_env_sample;")
        c.bump("ENVIRONMENT")
        c.write_release()
        rc, out = c.check()
        expect(rc, out, False, "struct rlh_env_sample grew, but it crosses the boundary as an array",
               "rlh_environment_api.score")
    elif name == "const_renumbered_with_bump_fails":
        c.edit(c.hdr("core.h"), "#define RLH_E_INTERNAL 13\n", "#define RLH_E_INTERNAL 17\n")
        c.bump()
        c.write_release()
        rc, out = c.check()
        expect(rc, out, False, "const RLH_E_INTERNAL changed from '13' to '17'")
    elif name == "slot_signature_change_fails":
        c.edit(env_h, "const rlh_env_sample* samples, size_t num_samples,",
               "const rlh_env_sample* samples, int64_t num_samples,")
        rc, out = c.check()
        expect(rc, out, False, "-field rlh_environment_api score 32 8 8",
               "+field rlh_environment_api score 32 8 8 rlh_status *(*)(rlh_environment *, const rlh_env_sample *, int64_t")
    elif name == "typedef_signature_change_fails":
        c.edit(c.hdr("core.h"), "typedef void (*rlh_write_fn)(void* user, const void* data, size_t len);",
               "typedef void (*rlh_write_fn)(void* user, const char* data, size_t len);")
        rc, out = c.check()
        expect(rc, out, False, "+typedef rlhost/core.h rlh_write_fn void (*)(void *, const char *, unsigned long)")
    elif name == "slot_asserts_catch_insert":
        compile_slot_asserts(c, expect_ok=True)  # control: the committed file compiles
        c.edit(env_h, MID_OLD, MID_NEW)
        out = compile_slot_asserts(c, expect_ok=False)
        if "rlh_environment_api.destroy must stay" not in out:
            raise Fail(f"the slot asserts failed for another reason:\n{out}")
    elif name == "frozen_modified_fails":
        f = c.abi / "frozen" / f"{ma}.{mi}" / "rlhost" / "environment.h"
        c.edit(f, MID_OLD, MID_NEW)
        rc, out = c.check()
        expect(rc, out, False, f"abi/frozen/{ma}.{mi} does not match abi/layout/{ma}.{mi}.txt")
    elif name == "changelog_entry_missing_fails":
        cl = c.abi / "CHANGELOG.md"
        text = cl.read_text(encoding="utf-8")
        cl.write_text(re.sub(rf"^## {ma}\.{mi}\b", f"## {ma}.{mi}-draft", text, flags=re.M), encoding="utf-8")
        rc, out = c.check()
        expect(rc, out, False, f"abi/CHANGELOG.md has no entry '## {ma}.{mi}'")
    elif name == "golden_edited_in_place_fails_history":
        # Regenerate the golden AND patch the CHANGELOG's sha256 for the same version: the layout
        # check alone cannot tell, the write-once history check must.
        if shutil.which("git") is None:
            print("SKIP: git not found")
            raise SystemExit(SKIP)
        git = ["git", "-C", str(c.abi.parent), "-c", "user.name=t", "-c", "user.email=t@t",
               "-c", "commit.gpgsign=false"]
        subprocess.run(git[:3] + ["init", "-q"], check=True)
        subprocess.run(git + ["add", "."], check=True)
        subprocess.run(git + ["commit", "-q", "-m", "release"], check=True)
        rc, out = c.run("history", "--repo", str(c.abi.parent))
        expect(rc, out, True, "ABI history check passed")  # control
        c.edit(env_h, END_OLD, END_NEW)
        c.write_release(changelog=False, force=True)
        import hashlib
        sha = hashlib.sha256((c.abi / "layout" / f"{ma}.{mi}.txt").read_bytes()).hexdigest()
        cl = c.abi / "CHANGELOG.md"
        cl.write_text(re.sub(r"(layout sha256: `)[0-9a-f]{64}", rf"\g<1>{sha}", cl.read_text(encoding="utf-8"),
                             count=1), encoding="utf-8")
        rc, out = c.run("history", "--repo", str(c.abi.parent))
        expect(rc, out, False, "uncommitted changes modify released ABI files", f"layout/{ma}.{mi}.txt")
        subprocess.run(git + ["commit", "-q", "-am", "fix golden in place"], check=True)
        rc, out = c.run("history", "--repo", str(c.abi.parent))
        expect(rc, out, False, "fix golden in place", "modified released ABI files")
    else:
        raise SystemExit(f"unknown scenario {name}")


def compile_slot_asserts(c: Copy, expect_ok: bool) -> str:
    clang = os.environ.get("RLH_CLANG") or shutil.which("clang-14") or shutil.which("cc")
    r = subprocess.run([clang, "-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror", "-fsyntax-only",
                        "-I", str(c.abi / "include"), str(c.abi / "tools" / "slot_asserts.c")],
                       capture_output=True, text=True)
    if expect_ok and r.returncode != 0:
        raise Fail(f"slot_asserts.c must compile against the headers it was generated for:\n{r.stderr}")
    if not expect_ok and r.returncode == 0:
        raise Fail("slot_asserts.c compiled against headers with a field inserted mid-struct")
    return r.stderr


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--abi-dir", required=True)
    ap.add_argument("--extra-header", action="append", default=[])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlh_abi_selftest_") as tmp:
        c = Copy(Path(a.abi_dir).resolve(), Path(tmp), a.extra_header)
        try:
            scenario(a.scenario, c)
        except Fail as e:
            print(f"SELFTEST FAILED [{a.scenario}]: {e}", file=sys.stderr)
            return 1
    print(f"selftest {a.scenario}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
