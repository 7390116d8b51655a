#!/usr/bin/python3
"""Reference renderer for the chat-template tests: Python Jinja2 configured like transformers'
apply_chat_template (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
tojson without ASCII escaping, raise_exception, strftime_now).

    render_jinja.py cases.json out.json

cases.json: [{"template": str, "vars": {...}}]; out.json: [{"ok": text} | {"error": message}].
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    out = []
    for c in cases:
        try:
            out.append({"ok": env.from_string(c["template"]).render(**c["vars"])})
        except Exception as e:  # noqa: BLE001 - any failure is compared as "both fail"
            out.append({"error": f"{type(e).__name__}: {e}"})
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
