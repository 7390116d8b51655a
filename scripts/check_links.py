#!/usr/bin/env python3
"""Fails when a plugin links another plugin's library or the SDK names a plugin.

rlhost's rule (docs/architecture.md): plugins meet only through the ABI registry. So
  1. no target defined under plugins/X depends on a target defined under plugins/Y (X != Y),
  2. no target defined under sdk/, host/ or abi/ depends on a target defined under plugins/,
  3. no source under sdk/, host/ or abi/ includes a plugin's headers, and no plugin includes
     another plugin's headers ("rlhost/<plugin>/..." where <plugin> is a plugin folder with an
     include/rlhost/<plugin> directory of its own).
Targets and their dependencies come from CMake's file API (codemodel v2) of a configured build
tree. CMake reads queries when a configure starts: scripts/test.sh writes the query before its
first configure, and the top-level CMakeLists.txt writes it for the next one, so a build folder
configured once by hand lacks the reply until its next configure (exit 77: ctest's skip).
  scripts/check_links.py BUILD_DIR
Exit 0 when clean; otherwise one line per violation and exit 1.
"""
import json
import os
import re
import sys


def load_codemodel(build):
    reply = os.path.join(build, ".cmake", "api", "v1", "reply")
    if not os.path.isdir(reply):
        print(f"check_links: no CMake file API reply in {reply} yet: re-run cmake on the build folder "
              "(scripts/test.sh asks for it before configuring)")
        sys.exit(77)
    index = sorted(f for f in os.listdir(reply) if f.startswith("index-"))
    if not index:
        sys.exit(f"check_links: no file API index in {reply}")
    with open(os.path.join(reply, index[-1])) as f:
        idx = json.load(f)
    cm_file = idx["reply"]["codemodel-v2"]["jsonFile"]
    with open(os.path.join(reply, cm_file)) as f:
        cm = json.load(f)
    source_root = cm["paths"]["source"]
    targets = {}
    for cfg in cm["configurations"][:1]:
        for t in cfg["targets"]:
            with open(os.path.join(reply, t["jsonFile"])) as f:
                tj = json.load(f)
            targets[t["id"]] = tj
    return source_root, targets


def area(source_dir):
    """('plugin', name), ('core', 'sdk'|'host'|'abi') or ('other', path) of a target's folder."""
    parts = source_dir.replace("\\", "/").split("/")
    if parts and parts[0] == "plugins" and len(parts) > 1:
        return ("plugin", parts[1])
    if parts and parts[0] in ("sdk", "host", "abi"):
        return ("core", parts[0])
    return ("other", source_dir)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: check_links.py BUILD_DIR")
    source_root, targets = load_codemodel(sys.argv[1])
    where = {tid: area(t["paths"]["source"]) for tid, t in targets.items()}
    names = {tid: t["name"] for tid, t in targets.items()}
    bad = []
    for tid, t in targets.items():
        a = where[tid]
        if a[0] not in ("plugin", "core"):
            continue
        for dep in t.get("dependencies", []):
            b = where.get(dep["id"])
            if b is None or b[0] != "plugin":
                continue
            if a[0] == "plugin" and b[1] != a[1]:
                bad.append(f"plugin {a[1]}: target {names[tid]} depends on {names[dep['id']]} of plugin {b[1]}")
            elif a[0] == "core":
                bad.append(f"{a[1]}: target {names[tid]} depends on {names[dep['id']]} of plugin {b[1]}")

    # Headers: a plugin's public include folder is its own.
    plugins_dir = os.path.join(source_root, "plugins")
    owned = {}
    for p in sorted(os.listdir(plugins_dir)):
        inc = os.path.join(plugins_dir, p, "include", "rlhost")
        if os.path.isdir(inc):
            for sub in os.listdir(inc):
                owned[sub] = p
    include = re.compile(r'^\s*#\s*include\s*[<"]rlhost/([A-Za-z0-9_]+)/')
    for top in ("sdk", "host", "abi", "plugins"):
        for dirpath, _, files in os.walk(os.path.join(source_root, top)):
            for fn in files:
                if not fn.endswith((".h", ".hpp", ".c", ".cc", ".cpp", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, fn)
                rel = os.path.relpath(path, source_root)
                here = area(os.path.dirname(rel))
                with open(path, errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = include.match(line)
                        if not m or m.group(1) not in owned:
                            continue
                        owner = owned[m.group(1)]
                        if here[0] == "core" or (here[0] == "plugin" and here[1] != owner):
                            bad.append(f"{rel}:{n}: includes rlhost/{m.group(1)}/ of plugin {owner}")
    for b in bad:
        print("check_links: " + b)
    if bad:
        print(f"check_links: {len(bad)} violation(s): plugins meet only through the ABI registry")
        return 1
    print(f"check_links: {len(targets)} targets, no plugin links another plugin, the SDK names no plugin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
