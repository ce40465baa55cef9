"""What ran where and when: spans of work on lanes (pipeline stages, ranks), simulated or recorded by a real run.

`llmlab.parallel.pipeline` records each stage's forwards and backwards into a `Timeline` (simulated or measured),
`llmlab.dist.overlap` each rank's compute and communication; `llmlab.plots.plot_timeline` draws either.

    t = Timeline((Span(0, "F", 0, 0.0, 1.0), Span(1, "F", 0, 1.0, 2.0)), lane_name="stage")
    t.lanes, t.makespan, t.idle                # (0, 1), 2.0, 0.5: each stage idle half of the time
    Timeline.merge(per_rank)                   # one timeline from the timelines each rank recorded
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmlab import validation

__all__ = ["Span", "Timeline"]


@dataclass(frozen=True)
class Span:
    """One piece of work: on which lane, what, which one, from when to when."""

    lane: int  # the row it ran on: a pipeline stage, a rank
    kind: str  # what ran: "F" or "B" (a forward, a backward), "compute" or "comm"
    item: int  # which one: the micro-batch, the layer
    start: float  # seconds (or simulated time units)
    end: float

    def __post_init__(self):
        validation.integer("lane", self.lane, low=0)
        if not self.end >= self.start:
            raise ValueError(f"end={self.end!r} must be >= start={self.start!r}")

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Spans on lanes; `lane_name` says what a lane is ("stage", "rank") for labels."""

    spans: tuple[Span, ...]
    lane_name: str = "lane"

    def __post_init__(self):
        if not isinstance(self.spans, tuple) or not all(isinstance(s, Span) for s in self.spans):
            raise ValueError(f"spans must be a tuple of Span, got {type(self.spans).__name__}")
        if not self.spans:
            raise ValueError("spans must hold at least one Span: an empty timeline has no start or end")

    @classmethod
    def merge(cls, timelines: Iterable[Timeline]) -> Timeline:
        """One timeline of the spans of all `timelines` (e.g. the one each rank recorded), on the same kind of lane."""
        timelines = list(timelines)
        if not timelines:
            raise ValueError("timelines must hold at least one Timeline")
        names = {t.lane_name for t in timelines}
        if len(names) > 1:
            raise ValueError(f"timelines have different lane names {sorted(names)}: merge lanes of one kind")
        return cls(tuple(s for t in timelines for s in t.spans), timelines[0].lane_name)

    @property
    def lanes(self) -> tuple[int, ...]:
        """The lanes that hold a span, in order."""
        return tuple(sorted({s.lane for s in self.spans}))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of span, in the order they first start."""
        return tuple(dict.fromkeys(s.kind for s in sorted(self.spans, key=lambda s: s.start)))

    @property
    def start(self) -> float:
        return min(s.start for s in self.spans)

    @property
    def end(self) -> float:
        return max(s.end for s in self.spans)

    @property
    def makespan(self) -> float:
        """From the first start to the last end."""
        return self.end - self.start

    def on(self, lane: int) -> tuple[Span, ...]:
        """The spans of `lane`, by start."""
        return tuple(sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.start))

    def busy(self, lane: int) -> float:
        """The time in which `lane` ran anything: spans that run at the same time (compute and communication) count
        once."""
        total, reach = 0.0, None
        for s in self.on(lane):
            if reach is None or s.start >= reach:
                total, reach = total + s.duration, s.end
            elif s.end > reach:
                total, reach = total + s.end - reach, s.end
        return total

    @property
    def idle(self) -> float:
        """The share of the lanes' time between the first start and the last end in which they ran nothing: a
        pipeline's bubble. 0 when no time passed at all."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy(lane) for lane in self.lanes) / (len(self.lanes) * self.makespan)
