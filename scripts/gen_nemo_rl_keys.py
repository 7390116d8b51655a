#!/usr/bin/env python3
"""Generates host/data/nemo_rl_keys.tsv: every configuration key NeMo-RL defines, per version.

Sources, for each git ref of a NeMo-RL checkout (NVIDIA-NeMo/RL):
  - its config definitions: every TypedDict / pydantic BaseModel reachable from a `MasterConfig`
    class under nemo_rl/ (parsed with `ast`, never imported: no NeMo-RL dependency is needed), a
    field declared as a class holding that class's subclasses' fields too;
  - its example configurations: every examples/configs/**/*.yaml (recipes included) and the files
    their `defaults:` chains name, whose keys are collected as written (maps recurse, lists are
    values; anchors and `<<` merges expanded).

A field typed as a free-form mapping (`dict[str, Any]`, `Any`, a mapping alias) makes a "tree":
the key and everything under it are known (`env`, `policy.hf_config_overrides`, ...).

Output, one key per line, sorted:  key <TAB> kind <TAB> refs <TAB> sources
  kind     leaf | tree | map   (map: a mapping whose keys are listed on their own lines)
  refs     the refs that define the key, comma-separated, in the order given
  sources  "schema", "examples" or "schema+examples"

Usage (Python 3 with python3-yaml; needs `git`):
  scripts/gen_nemo_rl_keys.py --git-dir RL/.git --refs v0.3.0 v0.4.0 v0.5.0 v0.6.0 v0.7.0 main \
      --out host/data/nemo_rl_keys.tsv
"""
import argparse
import ast
import posixpath
import subprocess
import sys

import yaml  # Debian: python3-yaml


def git(git_dir, *args):
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True,
                          capture_output=True).stdout


# ---------------------------------------------------------------------------------------------
# Config definitions (ast)

SCALAR_NAMES = {"int", "float", "str", "bool", "bytes", "None", "NoneType", "Literal", "list",
                "List", "tuple", "Tuple", "set", "Set", "Sequence", "Callable", "Path", "type"}
MAPPING_NAMES = {"dict", "Dict", "Mapping", "MutableMapping", "Any", "object", "OrderedDict",
                 "DictConfig"}
WRAPPERS = {"NotRequired", "Required", "Optional", "Annotated", "Final", "ReadOnly"}


class Module:
    def __init__(self, name, tree):
        self.name = name
        self.classes = {}   # qualified name -> ast.ClassDef
        self.aliases = {}   # name -> annotation expression
        self.imports = {}   # local name -> (module, name)
        for node in tree.body:
            self._visit(node, "")

    def _visit(self, node, prefix):
        if isinstance(node, ast.ClassDef):
            q = prefix + node.name
            self.classes[q] = node
            for sub in node.body:
                if isinstance(sub, ast.ClassDef):
                    self._visit(sub, q + ".")
        elif isinstance(node, ast.ImportFrom) and node.module and not prefix:
            for a in node.names:
                self.imports[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Assign) and not prefix and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            self.aliases[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and not prefix and isinstance(node.target, ast.Name) \
                and node.value is not None and _is_name(node.annotation, "TypeAlias"):
            self.aliases[node.target.id] = node.value
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in node.body:
                self._visit(sub, prefix)


def _is_name(expr, name):
    return (isinstance(expr, ast.Name) and expr.id == name) or \
           (isinstance(expr, ast.Attribute) and expr.attr == name)


def _name_of(expr):
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


class Schema:
    """Resolves annotations across the modules of one ref."""

    def __init__(self, modules):
        self.modules = modules  # module name -> Module
        # A field declared as a config class holds one of its subclasses too (NeMo-RL's
        # `generation: GenerationConfig` holds a VllmConfig): (module, class) -> subclasses.
        self.subclasses = {}
        for mod in modules.values():
            for cls in mod.classes.values():
                for b in cls.bases:
                    n = _name_of(b.value if isinstance(b, ast.Subscript) else b)
                    found = self.lookup(mod, n) if n else None
                    if found and found[0] == "class":
                        bm, bc = found[1]
                        self.subclasses.setdefault((bm.name, bc.name), []).append((mod, cls))

    def lookup(self, module, name, depth=0):
        """(kind, payload): ("class", (Module, ClassDef)), ("alias", (Module, expr)) or None."""
        if depth > 8 or module is None:
            return None
        if name in module.classes:
            return ("class", (module, module.classes[name]))
        if name in module.aliases:
            return ("alias", (module, module.aliases[name]))
        if name in module.imports:
            mod, orig = module.imports[name]
            target = self.modules.get(mod) or self.modules.get(mod + ".__init__")
            if target is not None:
                return self.lookup(target, orig, depth + 1)
        return None

    def is_config_class(self, module, cls, depth=0):
        if depth > 12:
            return False
        for b in cls.bases:
            n = _name_of(b.value if isinstance(b, ast.Subscript) else b)
            if n in ("TypedDict", "BaseModel"):
                return True
            found = self.lookup(module, n) if n else None
            if found and found[0] == "class" and self.is_config_class(*found[1], depth + 1):
                return True
        return False

    def fields(self, module, cls, depth=0):
        """Ordered {field: (annotation, module)} including bases'."""
        out = {}
        if depth > 12:
            return out
        for b in cls.bases:
            n = _name_of(b.value if isinstance(b, ast.Subscript) else b)
            found = self.lookup(module, n) if n else None
            if found and found[0] == "class":
                out.update(self.fields(*found[1], depth + 1))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if _is_name(node.annotation, "ClassVar") or (
                        isinstance(node.annotation, ast.Subscript) and
                        _is_name(node.annotation.value, "ClassVar")):
                    continue
                if node.target.id in ("model_config",):
                    continue
                out[node.target.id] = (node.annotation, module)
        return out

    def classify(self, expr, module, depth=0):
        """Returns (is_tree, [(Module, ClassDef), ...]) for an annotation."""
        if depth > 24 or expr is None:
            return False, []
        if isinstance(expr, ast.Constant):
            if isinstance(expr.value, str):  # a forward reference
                try:
                    return self.classify(ast.parse(expr.value, mode="eval").body, module, depth + 1)
                except SyntaxError:
                    return False, []
            return False, []
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            t1, c1 = self.classify(expr.left, module, depth + 1)
            t2, c2 = self.classify(expr.right, module, depth + 1)
            return t1 or t2, c1 + c2
        if isinstance(expr, ast.Subscript):
            head = _name_of(expr.value)
            args = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            if head in WRAPPERS:
                return self.classify(args[0], module, depth + 1)
            if head == "Union":
                tree, classes = False, []
                for a in args:
                    t, c = self.classify(a, module, depth + 1)
                    tree, classes = tree or t, classes + c
                return tree, classes
            if head in MAPPING_NAMES:
                return True, []
            if head in SCALAR_NAMES:
                return False, []
            found = self.lookup(module, head) if head else None
            if found and found[0] == "alias":
                return self.classify(found[1][1], found[1][0], depth + 1)
            return False, []
        n = _name_of(expr)
        if n is None:
            return False, []
        if n in MAPPING_NAMES:
            return True, []
        if n in SCALAR_NAMES:
            return False, []
        found = self.lookup(module, n)
        if not found:
            return False, []
        if found[0] == "alias":
            return self.classify(found[1][1], found[1][0], depth + 1)
        mod, cls = found[1]
        if self.is_config_class(mod, cls):
            return False, [(mod, cls)]
        return False, []

    def with_subclasses(self, classes):
        out, todo, seen = [], list(classes), set()
        while todo:
            m, c = todo.pop(0)
            if (m.name, c.name) in seen:
                continue
            seen.add((m.name, c.name))
            if self.is_config_class(m, c):
                out.append((m, c))
            todo.extend(self.subclasses.get((m.name, c.name), []))
        return out

    def walk(self, mod, cls, prefix, out, stack):
        """Adds every key under class `cls` at `prefix` to out: key -> kind."""
        ident = (mod.name, cls.name)
        if ident in stack or len(stack) > 16:
            return
        stack = stack + [ident]
        for field, (ann, fmod) in self.fields(mod, cls).items():
            key = prefix + field
            tree, classes = self.classify(ann, fmod)
            if tree:
                out[key] = "tree"
            elif classes:
                if out.get(key) != "tree":
                    out[key] = "map"
                for m, c in self.with_subclasses(classes):
                    self.walk(m, c, key + ".", out, stack)
            else:
                out.setdefault(key, "leaf")


def schema_keys(git_dir, ref):
    names = git(git_dir, "ls-tree", "-r", "--name-only", ref, "nemo_rl").decode().split("\n")
    modules = {}
    for path in names:
        if not path.endswith(".py"):
            continue
        text = git(git_dir, "show", f"{ref}:{path}").decode("utf-8", "replace")
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            print(f"gen_nemo_rl_keys: {ref}:{path}: skipped ({e.msg})", file=sys.stderr)
            continue
        mod = path[:-3].replace("/", ".")
        modules[mod] = Module(mod, tree)
    schema = Schema(modules)
    out = {}
    for mod in modules.values():
        cls = mod.classes.get("MasterConfig")
        if cls is not None and schema.is_config_class(mod, cls):
            schema.walk(mod, cls, "", out, [])
    return out


# ---------------------------------------------------------------------------------------------
# Example configurations: examples/configs/**/*.yaml and the files their `defaults:` chains name
# outside it (examples/nemo_gym/..., examples/modelopt/...). Read with PyYAML (Debian's
# python3-yaml), which expands anchors, aliases and `<<` merge keys as OmegaConf does.

def defaults_of(text):
    """The file names a config's top-level `defaults:` names (a string or a list)."""
    try:
        d = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    if not isinstance(d, dict) or "defaults" not in d:
        return []
    v = d["defaults"]
    return [str(x) for x in (v if isinstance(v, list) else [v]) if x is not None]


def example_files(git_dir, ref):
    """{path: text} of examples/configs/**/*.yaml at `ref` and the parents their chains name."""
    names = [n for n in git(git_dir, "ls-tree", "-r", "--name-only", ref,
                            "examples/configs").decode().split("\n") if n.endswith(".yaml")]
    out, todo = {}, list(names)
    while todo:
        path = todo.pop()
        if path in out:
            continue
        try:
            text = git(git_dir, "show", f"{ref}:{path}").decode("utf-8", "replace")
        except subprocess.CalledProcessError:
            continue  # a parent missing at this ref (the config that names it fails to load)
        out[path] = text
        for parent in defaults_of(text):
            if not parent.startswith("/"):
                todo.append(posixpath.normpath(posixpath.join(posixpath.dirname(path), parent)))
    return out


def yaml_keys(data, prefix, out):
    """Dotted key paths of a loaded document: maps recurse, anything else is a value."""
    if not isinstance(data, dict):
        return
    for k, v in data.items():
        k = str(k)
        if not prefix and k == "defaults":
            continue
        if k == "_override_":  # NeMo-RL's "replace, do not merge" marker, not a key
            continue
        path = prefix + k
        if isinstance(v, dict) and v:
            out[path] = "map"
            yaml_keys(v, path + ".", out)
        elif out.get(path) != "map":
            out[path] = "leaf"


def example_keys(git_dir, ref):
    out = {}
    for path, text in example_files(git_dir, ref).items():
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            print(f"gen_nemo_rl_keys: {ref}:{path}: not YAML ({e})", file=sys.stderr)
            continue
        yaml_keys(data, "", out)
    return out


# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--git-dir", required=True)
    ap.add_argument("--refs", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    merged = {}  # key -> {"kind", "refs": [], "sources": set()}
    header = []
    for ref in a.refs:
        sha = git(a.git_dir, "rev-parse", ref + "^{commit}").decode().strip()
        header.append(f"# {ref} {sha}")
        sk = schema_keys(a.git_dir, ref)
        ek = example_keys(a.git_dir, ref)
        for src, keys in (("schema", sk), ("examples", ek)):
            for k, kind in keys.items():
                e = merged.setdefault(k, {"kind": kind, "refs": [], "sources": set()})
                # tree wins over map wins over leaf: a key that is a mapping anywhere is one
                order = {"leaf": 0, "map": 1, "tree": 2}
                if order[kind] > order[e["kind"]]:
                    e["kind"] = kind
                if not e["refs"] or e["refs"][-1] != ref:
                    e["refs"].append(ref)
                e["sources"].add(src)
        print(f"gen_nemo_rl_keys: {ref}: {len(sk)} schema keys, {len(ek)} example keys",
              file=sys.stderr)

    # Keys inside a tree are covered by it; keep the tree alone.
    trees = sorted(k for k, e in merged.items() if e["kind"] == "tree")
    def under_tree(k):
        parts = k.split(".")
        return any(".".join(parts[:i]) in merged and merged[".".join(parts[:i])]["kind"] == "tree"
                   for i in range(1, len(parts)))
    rows = []
    for k in sorted(merged):
        if under_tree(k):
            continue
        e = merged[k]
        src = "+".join(s for s in ("schema", "examples") if s in e["sources"])
        rows.append(f"{k}\t{e['kind']}\t{','.join(e['refs'])}\t{src}")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write("# NeMo-RL configuration keys. Generated by scripts/gen_nemo_rl_keys.py; do not edit.\n")
        f.write("# refs (NVIDIA-NeMo/RL): " + " ".join(a.refs) + "\n")
        for h in header:
            f.write(h + "\n")
        f.write("# key\tkind\trefs\tsources\n")
        for r in rows:
            f.write(r + "\n")
    print(f"gen_nemo_rl_keys: {len(rows)} keys ({len(trees)} trees) -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
