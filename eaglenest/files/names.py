"""User-written names and YAML that become paths and settings: checked where they are read.

A name that becomes a path (a part, a synthetic part, a profile) is a plain file name, so it can
never reach outside the folder it names a file in. A YAML file a user writes (params.yaml, a
profile) may not set a key twice: YAML loaders keep the last value silently, DVC refuses the file."""

import re
from pathlib import Path

import yaml

from eaglenest.runtime.errors import EaglenestError

PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


RULE = "letters, digits, '.', '_' and '-' (it becomes a file name; no '/', '..' or leading dot)"


def is_plain(name) -> bool:
    return isinstance(name, str) and PLAIN.fullmatch(name) is not None and ".." not in name


def plain_name(name, what: str) -> str:
    """`name` if it is a plain file name, else an error naming it and `what` it is."""
    if not is_plain(name):
        raise EaglenestError(f"{what} {name!r} is not a plain name: use {RULE}")
    return name


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with a key set twice, naming the key and both lines."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base loader says so
                break
            if first != line:
                raise EaglenestError(f"{self.name}:{line}: key `{key}` is set twice (first on line {first}); keep one")
        return super().construct_mapping(node, deep)


def load_yaml(path: Path):
    """A user's YAML file, strictly: a duplicated key or bad YAML is one line naming the file."""
    path = Path(path)
    text = path.read_text()
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise EaglenestError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        loader.dispose()
