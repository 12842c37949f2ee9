"""Placement: which variables live on parameter-server tasks and which are replicated on every worker.

Placement is data: a mapping from a regular expression over variable paths (``"embedding/embeddings"``) to
``"ps"`` or ``"replicated"``. Built-in default: every ``tf.keras.layers.Embedding`` table goes to PS; every other
variable is replicated. User rules override the default; a path matched by two user rules is an error.
"""

import dataclasses
import re
from typing import Mapping, Optional, Tuple

PS = "ps"
REPLICATED = "replicated"
WHERE = (PS, REPLICATED)


@dataclasses.dataclass(frozen=True)
class Decision:
    where: str          # PS or REPLICATED
    why: str            # human-readable reason, logged once per variable
    ps_task: Optional[int] = None


class Placement:
    """Decides where each variable goes and, for PS variables, on which PS task.

    Args:
      rules: mapping from regex (``re.fullmatch`` against the variable path without ``:0``) to ``"ps"`` or
        ``"replicated"``.
      num_ps: number of PS tasks; PS variables are spread over them greedily by size (largest load first).
    """

    def __init__(self, rules: Optional[Mapping[str, str]] = None, num_ps: int = 0):
        self._rules: Tuple[Tuple[str, "re.Pattern", str], ...] = ()
        compiled = []
        for pattern, where in dict(rules or {}).items():
            if where not in WHERE:
                raise ValueError(f"A placement rule maps to one of {WHERE}. Received: {{{pattern!r}: {where!r}}}.")
            try:
                compiled.append((pattern, re.compile(pattern), where))
            except re.error as e:
                raise ValueError(f"Placement rule {pattern!r} is not a valid regular expression ({e}). "
                                 f"Received: {pattern!r}.") from None
        self._rules = tuple(compiled)
        self._ps_load = [0] * num_ps

    def decide(self, path: str, num_elements: int, is_embedding: bool) -> Decision:
        matches = [(p, w) for p, r, w in self._rules if r.fullmatch(path)]
        if len(matches) > 1:
            raise ValueError(
                f"Variable {path!r} matches two placement rules: {matches[0][0]!r} -> {matches[0][1]!r} and "
                f"{matches[1][0]!r} -> {matches[1][1]!r}. Make the patterns disjoint. Received: rules="
                f"{[p for p, _, _ in self._rules]}.")
        if matches:
            where, why = matches[0][1], f"placement rule {matches[0][0]!r}"
        elif is_embedding:
            where, why = PS, "tf.keras.layers.Embedding table (sparse gradient)"
        else:
            where, why = REPLICATED, "dense variable (default)"
        if where == REPLICATED:
            return Decision(REPLICATED, why)
        if not self._ps_load:
            raise ValueError(
                f"Variable {path!r} must live on a parameter server ({why}), but the cluster has no PS task. "
                "Received: num_ps=0. Start PS tasks (kparallax-run --ps 1 ...) or map it to 'replicated' with "
                f"placement={{{path!r}: 'replicated'}}.")
        task = min(range(len(self._ps_load)), key=lambda i: (self._ps_load[i], i))
        self._ps_load[task] += num_elements
        return Decision(PS, why, task)
