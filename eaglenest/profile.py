"""Params profiles: a profile is an override file (`profiles/<name>.yaml`) holding only the keys that
differ from `params.yaml`, as `section: {key: value}`. Applying it sets each `section.key` in
params.yaml to the profile's value, whole (as `dvc exp run -S section.key=value` would), keeping
params.yaml's comments and order. A key the params file lacks is an error: a profile cannot drift
from the default the way a full copy does. A profile may build on another (`extends: <name>`, a profile
of the same directory): the other's keys first, then its own, so a larger profile holds only what
differs from the one it grows."""

import io
import json
from pathlib import Path

from ruamel.yaml import YAML, YAMLError
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from eaglenest.files.atomic import replaced_file
from eaglenest.files.names import load_yaml, plain_name
from eaglenest.runtime.errors import EaglenestError


def _yaml() -> YAML:
    y = YAML()  # round-trip: comments, order and quoting survive
    y.preserve_quotes = True
    y.width = 110
    y.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return y


def _styled(value):
    """A new value in params.yaml's own style: lists and mappings of scalars inline, other mappings as
    blocks. A list is always inline: a block list of lists keeps the newline after it in its last
    item, which replacing the list again dropped (joining the next key onto its line)."""
    if isinstance(value, dict):
        out = CommentedMap((k, _styled(v)) for k, v in value.items())
    elif isinstance(value, list):
        out = CommentedSeq(_styled(v) for v in value)
    else:
        return value
    if isinstance(value, list) or not any(isinstance(v, (dict, list)) for v in value.values()):
        out.fa.set_flow_style()
    return out


def overrides(profile: Path, _seen: tuple[Path, ...] = ()) -> dict[str, object]:
    """{"section.key": value} of a profile file, its `extends` chain's keys under its own."""
    profile = Path(profile)
    if not profile.is_file():
        known = sorted(p.stem for p in profile.parent.glob("*.yaml")) if profile.parent.is_dir() else []
        raise EaglenestError(f"{profile}: no such profile (known: {', '.join(known) or 'none'})")
    if profile.resolve() in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, profile.resolve()))
        raise EaglenestError(f"{_seen[0]}: profiles extend each other in a loop: {chain}")
    data = load_yaml(profile) or {}  # a key set twice is refused, naming it
    if not isinstance(data, dict):
        raise EaglenestError(f"{profile}: must map params sections to keys")
    out = {}
    if (base := data.pop("extends", None)) is not None:
        if not isinstance(base, str):
            raise EaglenestError(f"{profile}: `extends` names a profile of {profile.parent}, e.g. `extends: gpu`")
        out = overrides(profile.parent / f"{plain_name(base, f'{profile}: extends')}.yaml", (*_seen, profile.resolve()))
    for section, keys in data.items():
        if not isinstance(keys, dict) or not keys:
            raise EaglenestError(f"{profile}: `{section}` must map keys of that params section to values")
        out.update({f"{section}.{k}": v for k, v in keys.items()})
    return out


def apply(profile: Path, params: Path, dry_run: bool = False) -> list[tuple[str, object, object]]:
    """Set the profile's keys in the params file; returns (key, old, new) of the keys that change."""
    load_yaml(params)  # bad YAML or a key set twice: refused before anything is written
    y = _yaml()
    doc = y.load(Path(params).read_text())
    changes = []
    for key, value in overrides(profile).items():
        section, name = key.split(".", 1)
        if section not in doc or not hasattr(doc[section], "keys") or name not in doc[section]:
            raise EaglenestError(
                f"{profile}: `{key}` is not a key of {params}; a profile only changes keys "
                f"the default params define (add it there first)"
            )
        if doc[section][name] != value:
            changes.append((key, doc[section][name], value))
            doc[section][name] = _styled(value)
    if not dry_run:
        text = io.StringIO()
        y.dump(doc, text)
        if _read_back(text.getvalue()) != json.loads(json.dumps(doc)):  # the values alone, no comments
            raise EaglenestError(f"{params}: applying {profile} would not write the values it sets; left as it was")
        with replaced_file(Path(params)) as tmp:
            Path(tmp).write_text(text.getvalue())
    return changes


def _read_back(text: str):
    try:
        return YAML(typ="safe").load(text)
    except YAMLError:
        return None


def apply_sets(sets: list[str], params: Path, scratch: Path) -> list[tuple[str, object, object]]:
    """`section.key=<yaml value>` overrides (as `dvc exp run -S`) applied by the same rule as a profile
    (each key must exist in params); scratch holds them as a profile file. Returns the changes."""
    extra: dict = {}
    for s in sets:
        key, sep, value = s.partition("=")
        section, dot, name = key.partition(".")
        if not (sep and dot and section and name):
            raise EaglenestError(f"-S {s!r}: expected section.key=value")
        extra.setdefault(section, {})[name] = YAML(typ="safe").load(value)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    with replaced_file(scratch) as tmp:
        tmp.write_text(json.dumps(extra))  # JSON is YAML: the profile reader takes it
    return apply(scratch, params) if sets else []
