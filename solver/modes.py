"""Library modes as strategy objects: what differs between `vllm`, `general` and `paper`.

A stack's `coral:fleet.library.mode` names the template space it plans in. The name stays the
user-facing value (stack YAML, `--mode`, plan.json, library file names and their input
hashes); `LibrarySettings.strategy` turns it into one of the objects below, here and nowhere
else, and the stages call their methods instead of comparing names:

- which placement searches a multiset's best candidate is taken over (`candidates`; the
  searches themselves are `solver.serving`'s, handed in as `PlacementSearches`);
- whether a library's inputs include the coupled decode search's version (`coupled_decode`);
- whether stock vLLM runs the space's placements (`deployable`), and if not, why the Pulumi
  program refuses its plans (`deploy_problem`).

A library mode is not a runtime. The runtime (`PerfModel.runtime`: `vllm` by default, `helix`
for Helix's measurements) is the serving engine whose fixed per-layer and per-step costs the
performance model charges; it belongs to the performance model, whatever the mode, and a
library records both (`perf_model` and `mode` in its input hashes). Only the names overlap:
mode `vllm` is "placements stock vLLM can run", runtime `vllm` is "vLLM's overheads".

The market a stack rents from (`coral:fleet.market`: the catalog or the paper's Table 1) is a
separate setting with its own strategies (`solver.catalog.market.MarketSource`): paper-helix
plans in the paper's space on the catalog market.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

from solver.errors import InputError
from solver.types import LibPhase, Mode

C = TypeVar("C")  # a placed candidate (`solver.serving.candidates.Candidate`)
C_co = TypeVar("C_co", covariant=True)


class PlacementSearches(Protocol[C_co]):
    """The placement searches for one (model, phase) and node multiset, implemented by
    `solver.serving.enumeration`; a mode's `candidates` picks those its space holds. Each
    returns a placed candidate, or None when nothing fits the budgets."""

    @property
    def decode(self) -> bool:
        """The phase is disaggregated decode."""
        ...

    @property
    def node_count(self) -> int: ...

    @property
    def one_gpu_count(self) -> bool:
        """Every node of the multiset has the same number of GPUs."""
        ...

    def set_partition(self) -> C_co | None:
        """The paper's space: any set partition of the nodes into stages, data parallel inside
        a stage, each node whole at its best TP degree (labelled `general`)."""
        ...

    def paper(self) -> C_co | None:
        """The paper's space with coupled decode pipelines (labelled `paper`)."""
        ...

    def per_gpu_chain(self, label: Mode, decode_pp1: bool) -> C_co | None:
        """One TP=1 process per GPU, each its own stage; with `decode_pp1`, decode only on one
        GPU (vLLM's disaggregated decode runs PP=1)."""
        ...

    def per_node_chain(self, label: Mode) -> C_co | None:
        """One stage per node, all at the largest TP degree the (uniform) node size allows."""
        ...


class LibraryMode(ABC):
    """The behaviour of one library mode; one frozen instance per mode (`library_mode`)."""

    name: ClassVar[Mode]
    deployable: ClassVar[bool]
    """Stock vLLM runs every placement of this space: the Pulumi program deploys its plans, and
    `coral plan` refuses node configs the pinned vLLM build cannot run."""

    @abstractmethod
    def candidates(self, searches: PlacementSearches[C]) -> list[C | None]:
        """The placements of one multiset this space holds, in tie-break order (the caller
        keeps the first of the highest throughput; None: a search that found nothing)."""

    def coupled_decode(self, phase: LibPhase) -> bool:
        """Whether `phase`'s pipelines run one micro-batch size at every stage, so that the
        coupled search's version is one of the library's inputs."""
        return False

    def deploy_problem(self) -> str | None:
        """Why the Pulumi program refuses a plan in this space (with the setting to change);
        None when it deploys."""
        return None


@dataclass(frozen=True)
class VllmMode(LibraryMode):
    """What stock vLLM runs: a chain of one stage per node at one TP size (nodes all of one GPU
    count), or one stage per GPU at TP=1; disaggregated decode on a single node (PP=1)."""

    name: ClassVar[Mode] = "vllm"
    deployable: ClassVar[bool] = True

    def candidates(self, searches: PlacementSearches[C]) -> list[C | None]:
        if searches.decode and searches.node_count > 1:
            return []  # vLLM disaggregated decode runs PP=1
        found = [searches.per_gpu_chain(self.name, decode_pp1=True)]
        if searches.one_gpu_count:
            found.append(searches.per_node_chain(self.name))
        return found


@dataclass(frozen=True)
class GeneralMode(LibraryMode):
    """The paper's space (any set partition, DP inside a stage) plus vLLM's per-GPU chains, with
    multi-node decode: for simulation and benchmarks."""

    name: ClassVar[Mode] = "general"
    deployable: ClassVar[bool] = False

    def candidates(self, searches: PlacementSearches[C]) -> list[C | None]:
        # The paper's space; vLLM's chains are runnable too, so general includes them.
        return [searches.set_partition(), searches.per_gpu_chain(self.name, decode_pp1=False)]

    def deploy_problem(self) -> str | None:
        return (
            "coral:fleet.library.mode is 'general': only 'vllm' placements run on stock vLLM; "
            "set mode: vllm (use general for benchmarks only)"
        )


@dataclass(frozen=True)
class PaperMode(LibraryMode):
    """Exactly the paper's space (`solver.serving.paper_mode`), decode pipelines coupled: for
    the evaluation."""

    name: ClassVar[Mode] = "paper"
    deployable: ClassVar[bool] = False

    def candidates(self, searches: PlacementSearches[C]) -> list[C | None]:
        return [searches.paper()]

    def coupled_decode(self, phase: LibPhase) -> bool:
        return phase == "decode"

    def deploy_problem(self) -> str | None:
        return (
            "coral:fleet.library.mode is 'paper': the paper's template space "
            "(data-parallel stages, a TP degree per node, multi-node decode pipelines) is for "
            "evaluation and simulation; stock vLLM runs one TP size per pipeline and PP=1 on "
            "the disaggregated decode side, so it cannot run these placements; set mode: vllm "
            "to deploy"
        )


# One strategy per `Mode`, in its order (tests/templates/test_modes.py checks it).
LIBRARY_MODES: dict[str, LibraryMode] = {
    m.name: m for m in (VllmMode(), GeneralMode(), PaperMode())
}


def library_mode(name: str, field: str = "coral:fleet.library.mode") -> LibraryMode:
    """The strategy of the mode called `name`.

    Raises:
        InputError: an unknown name, naming `field` and the modes there are.
    """
    if name not in LIBRARY_MODES:
        *first, last = LIBRARY_MODES
        raise InputError(field, f"unknown mode '{name}'", f"use {', '.join(first)} or {last}")
    return LIBRARY_MODES[name]
