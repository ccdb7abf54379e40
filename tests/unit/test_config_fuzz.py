"""Any TOML document gets a Config or a ConfigError naming fields, never a traceback (issue 28: `listen = "host:abc"`
crashed `check`, `run` and every reload)."""

from __future__ import annotations

import math
import random
import tomllib
from pathlib import Path
from typing import Any

from supervisor.config import ConfigError
from supervisor.config_file import parse

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [tomllib.loads(p.read_text()) for p in sorted((ROOT / "examples").glob("*.toml"))]
SEEDS.append(tomllib.loads((ROOT / "deploy" / "config.toml").read_text()))
ODD: list[Any] = ["", " ", "host:abc", "127.0.0.1:", ":8000", "[::1]:x", "a:b:c", "h:٣", "ten", "-1", "1e400",
                  "auto", "on", "true", 0, -1, 1, 2**63, -(2**63), 0.0, -0.5, 1.5, math.inf, -math.inf, math.nan, True,
                  False, [], [1, "x"], ["a"], {}, {"k": "v"}, {"type": "pagerduty"}, [{"type": "webhook"}]]


def _mutate(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for _ in range(rng.randint(1, 4)):
        section = rng.choice([*out, "gateway", "admin", "alerts", "recovery", "nope"])
        if rng.random() < 0.1:
            out.pop(section, None)
            continue
        table = out.setdefault(section, {})
        if not isinstance(table, dict) or rng.random() < 0.05:
            out[section] = rng.choice(ODD)
            continue
        keys = list(table) or ["listen"]
        key = rng.choice([*keys, "listen", "metrics_listen", "hooks", "port", "spare", "unknown_key"])
        table[key] = rng.choice(ODD)
    return out


def test_thousands_of_mutated_configs_each_end_in_a_config_or_a_field_error() -> None:
    rng = random.Random(28)
    refused = 0
    for i in range(3000):
        doc = _mutate(rng.choice(SEEDS), rng)
        try:
            parse(doc, source=f"fuzz-{i}")
        except ConfigError as exc:
            refused += 1
            assert exc.problems and all(field and message for field, message in exc.problems), doc
        # anything else raised fails the test with the document in the traceback's locals
    assert refused > 1000  # the mutations do reach the validators
