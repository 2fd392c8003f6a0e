"""The jinja2 templates under `xpyd/templates/`, each rendered into the documents it holds."""

from __future__ import annotations

import json
from typing import Any, Final

import jinja2
import yaml

from xpyd.common.jsontypes import JSON

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("xpyd", "templates"),
    undefined=jinja2.StrictUndefined,
    autoescape=False,
    keep_trailing_newline=True,
    auto_reload=False,  # the templates are part of the package: no stat of each file per render
)
#: libyaml's parser where PyYAML was built with it (the same documents, several times faster).
_YAML_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# JSON is YAML: every structured value goes into the templates as JSON, so quoting is never wrong.
_ENV.filters["json"] = lambda value: json.dumps(value, separators=(", ", ": "))


def documents(template: str, **values: Any) -> list[JSON]:
    """The objects `template` renders to with `values`, empty documents left out."""
    text = _ENV.get_template(template).render(**values)
    return [doc for doc in yaml.load_all(text, Loader=_YAML_LOADER) if doc]
