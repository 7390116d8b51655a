#!/usr/bin/env python3
"""Copies NeMo-RL's example configurations into tests/host/nemo_rl_configs/, for the test that
loads every one of them (tests/host/test_nemo_rl_configs.cpp).

For each git ref: every examples/configs/**/*.yaml (recipes included), and the files outside
examples/configs that their `defaults:` chains name (examples/nemo_gym/..., examples/modelopt/...),
at the same relative paths, so the chains resolve as they do in NeMo-RL. Nothing else is copied.
NeMo-RL is Apache-2.0: its LICENSE is copied beside the files (README.md there says where they
come from).

Usage (standard library + git):
  scripts/copy_nemo_rl_configs.py --git-dir RL/.git --refs v0.3.0 v0.4.0 v0.5.0 v0.6.0 v0.7.0 main \
      --out tests/host/nemo_rl_configs
"""
import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_nemo_rl_keys import example_files  # noqa: E402  (the same set of files the key list reads)


def git(git_dir, *args):
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True,
                          capture_output=True).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--git-dir", required=True)
    ap.add_argument("--refs", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if os.path.isdir(a.out):
        for ref in a.refs:
            shutil.rmtree(os.path.join(a.out, ref), ignore_errors=True)
    total = 0
    shas = []
    for ref in a.refs:
        sha = git(a.git_dir, "rev-parse", ref + "^{commit}").decode().strip()
        shas.append((ref, sha))
        for path, text in example_files(a.git_dir, ref).items():
            dst = os.path.join(a.out, ref, path)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "w", encoding="utf-8") as f:
                f.write(text)
            total += 1
    lic = git(a.git_dir, "show", f"{a.refs[-1]}:LICENSE")
    with open(os.path.join(a.out, "LICENSE"), "wb") as f:
        f.write(lic)
    with open(os.path.join(a.out, "SOURCES"), "w") as f:
        for ref, sha in shas:
            f.write(f"{ref} {sha}\n")
    print(f"copy_nemo_rl_configs: {total} files under {a.out}")


if __name__ == "__main__":
    main()
