"""Where the options of a run come from: the flags, over a recipe file, over the schema's defaults.

    dualvllm train --config recipes/tiny-arith.yaml --output-dir runs/a --steps 20

    flags given (argparse; an unset flag is not a value)       highest
    the recipe file (YAML, read by pydantic-settings'
        YamlConfigSettingsSource; a `coordinator:` section
        is merged key by key)
    the defaults of the schema (training/config.py)            lowest

A recipe holds the options of `dualvllm train` (the fields of one method's class) under
their field names; `dualvllm eval` reads a training recipe too and skips its training
options. A key that is no option at all is refused, naming the key and the file. A value
from the file counts as given, as a flag does: a refusal that names an option the file
set says so, so the fix is found in the file.

Why argparse still parses the flags. pydantic-settings' CliSettingsSource would generate
them from the same schema, but it spells a field taking several values as a repeated flag
or a JSON list (`--reward exact --reward length`, `--reward '["exact","length"]'`), not
as today's `--reward exact length` (argparse's nargs="+"), which users' commands and the
tests use; and it would parse one model, while `train` takes the union of the method
classes' options and picks the class from `--method`. So argparse keeps the flags
(dualvllm/cli.py generates them from the schema), and this module lays them over the file.

Why the sources are merged here and not by BaseSettings. A pydantic-settings source runs
inside one BaseSettings class's `__init__`; the class of a training run is only known once
`method` is (from the flags, else the file), and is then chosen by validating the merged
values against the union of the method classes (dualvllm.training.config.TrainConfig.parse). So the
file is read with pydantic-settings' YAML source, and precedence is the one merge below.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Collection, Mapping

from pydantic_settings import BaseSettings, SettingsConfigDict, YamlConfigSettingsSource

from dualvllm.common.errors import InvalidInputError

# A recipe section whose keys are the options of an embedded config, merged key by key.
NESTED = "coordinator"


class _RecipeFile(BaseSettings):
    """The settings class the YAML source reads a recipe for: no fields, so every key of
    the file comes back as written and is checked by `read_recipe`, not dropped."""

    model_config = SettingsConfigDict(extra="allow")


def read_recipe(
    path: Path, options: Collection[str], *, nested_options: Collection[str] = (), skipped: Collection[str] = ()
) -> dict[str, Any]:
    """The options a recipe file sets, by name. `options` are the command's, `nested_options`
    those of its `coordinator:` section; keys in `skipped` (another command's options) are
    left out. Anything else, a missing file or one that is not a YAML mapping is refused."""
    import yaml

    if not path.is_file():  # the YAML source reads a missing file as an empty one
        raise InvalidInputError(f"--config {path}: no such recipe file")
    try:
        values = YamlConfigSettingsSource(_RecipeFile, yaml_file=path)()
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"--config {path}: not valid YAML: {' '.join(str(exc).split())}") from exc
    except (AttributeError, TypeError, ValueError) as exc:  # the YAML source takes a mapping at the top
        raise InvalidInputError(f"--config {path}: a recipe is a mapping of option: value, one a line") from exc
    unknown = [key for key in values if key not in options and key not in skipped]
    section = values.get(NESTED)
    if NESTED in options and section is not None:
        if not isinstance(section, dict):
            raise InvalidInputError(
                f"--config {path}: '{NESTED}' holds coordinator options (key: value), got {section!r}"
            )
        unknown += [f"{NESTED}.{key}" for key in section if key not in nested_options]
    if unknown:
        first = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        known = [f"{NESTED}.{key}" for key in nested_options] if first.startswith(f"{NESTED}.") else list(options)
        close = difflib.get_close_matches(first, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"the options are {', '.join(sorted(known))}"
        raise InvalidInputError(f"--config {path}: unknown option {first!r}{more}; {hint}")
    return {key: value for key, value in values.items() if key not in skipped}


@dataclass(frozen=True)
class Sources:
    """A run's options by origin: `flags` (keyword arguments: the flags given) over `recipe`
    (the file's values, read from `recipe_path`)."""

    flags: Mapping[str, Any]
    recipe: Mapping[str, Any] = field(default_factory=dict)
    recipe_path: Path | None = None

    @classmethod
    def read(
        cls,
        flags: Mapping[str, Any],
        recipe_path: Path | None,
        options: Collection[str],
        *,
        nested_options: Collection[str] = (),
        skipped: Collection[str] = (),
    ) -> Sources:
        recipe = (
            {}
            if recipe_path is None
            else read_recipe(recipe_path, options, nested_options=nested_options, skipped=skipped)
        )
        return cls(dict(flags), recipe, recipe_path)

    @property
    def merged(self) -> dict[str, Any]:
        """The values to validate: each flag over the file's value; the coordinator section key by key."""
        values = {**self.recipe, **self.flags}
        if isinstance(self.recipe.get(NESTED), dict) and isinstance(self.flags.get(NESTED), dict):
            values[NESTED] = {**self.recipe[NESTED], **self.flags[NESTED]}
        return values

    def from_file(self, name: str) -> bool:
        """Whether the value of option `name` is the recipe file's (not overridden by a flag)."""
        return name in self.recipe and name not in self.flags

    def origin(self, name: str) -> str:
        """Where the value of option `name` came from, for messages."""
        if self.from_file(name):
            return f"set in {self.recipe_path}"
        return f"set by {flag(name)}" if name in self.flags else "the default"

    def explain(self, error: InvalidInputError) -> InvalidInputError:
        """`error` with a note naming the options it mentions that the recipe file set."""
        message = str(error)
        named = [
            flag(name) if name != NESTED else NESTED
            for name in self.recipe
            if self.from_file(name)
            and re.search(rf"(?<![\w.-])({re.escape(flag(name))}(?![\w-])|{re.escape(name)}[=.])", message)
        ]
        if not named:
            return error
        return InvalidInputError(
            f"{message} ({', '.join(named)} {'is' if len(named) == 1 else 'are'} set in {self.recipe_path})"
        )


def flag(name: str) -> str:
    """The command-line spelling of option `name`."""
    return "--" + name.replace("_", "-")
