"""Pipeline schedule arithmetic: each device's order of forwards and backwards, the bubble,
and the micro-batches whose activations a stage holds at once.

TensorFlow-free and vectorised where the planner prices thousands of plans at
once; tfpar.parallel.schedules runs these orders, tfpar.layout.placement
predicts a run's memory from them and tfpar.planner prices them.

K stages, M micro-batches per replica batch, v chunks per device (interleaved
1F1B; 1 otherwise). The bubble, the idle fraction of each device's step while
the pipeline fills and drains, is (K - 1) / (v M + K - 1): GPipe and 1F1B with
v = 1, interleaved 1F1B v times smaller. Stage k holds the activations of M
micro-batches under GPipe, min(M, K - k) under 1F1B (K - k - 1 warm-up
forwards, then one forward and one backward in turn), and under interleaved
1F1B min(v M, 2 (K - k - 1) + (v - 1) K + 1) chunks of 1/v of a stage
(Narayanan et al. 2021; on stage 0 K (1 + (K - 1)/(K v)), Korthikanti et al. 2022).
`timetable` replays the orders slot by slot with the dataflow's dependencies:
it finds the bubble the formula gives (tests/test_schedules.py) and would
raise on an order that deadlocks.
"""

from typing import List, Sequence, Tuple

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved")
GPIPE, ONE_F_ONE_B, INTERLEAVED = range(len(SCHEDULES))
# The schedules whose order is TensorFlow's executor's (greedy dataflow), not one tfpar
# imposes: what a stage holds is then a bound (`held`).
BOUND = ("gpipe",)

Unit = Tuple[str, int, int]  # ("F" or "B", chunk, micro-batch)


def bubble(stages, microbatches, virtual=1):
  """The idle share of each stage's step: (K-1)/(vM + K-1), i.e. (K-1)/(vM) of the ideal time."""
  return (stages - 1) / (virtual * microbatches + stages - 1)


def in_flight(schedule, microbatches, virtual, stages: int) -> np.ndarray:
  """Micro-batches whose activations stage k = 0..K-1 holds at once ([..., K]; arrays broadcast).

  `schedule`: an index into SCHEDULES (or an array of them); a chunk counts 1/v.
  """
  k = np.arange(stages)
  schedule, m, v = np.asarray(schedule), np.asarray(microbatches), np.asarray(virtual)
  return np.select([schedule == GPIPE, schedule == ONE_F_ONE_B],
                   [m + 0 * k, np.minimum(m, stages - k)],
                   np.minimum(m * v, 2 * (stages - k - 1) + (v - 1) * stages + 1) / v)


def held(name: str, stages: int, microbatches: int, virtual: int,
         chunk_bytes: Sequence[float]) -> List[float]:
  """Per device, the most bytes of activations it holds at once, chunk c keeping chunk_bytes[c]
  of each micro-batch from its forward to its backward: `order` replayed on each device
  (under GPipe a bound, every micro-batch's: the executor's order is greedy)."""
  if name in BOUND:
    return [microbatches * chunk_bytes[k] for k in range(stages)]
  out = []
  for k in range(stages):
    live, peak = 0, 0
    for kind, c, _ in order(stages, microbatches, virtual, k):
      live += chunk_bytes[c] if kind == "F" else -chunk_bytes[c]
      peak = max(peak, live)
    out.append(peak)
  return out


def order(stages: int, microbatches: int, virtual: int, device: int) -> List[Unit]:
  """Device `device`'s (1F1B or interleaved 1F1B) sequence of forwards and backwards."""
  k, m_all, v = stages, microbatches, virtual
  # The i-th forward's (chunk, micro-batch): micro-batches in groups of K, each group through
  # the device's chunks in turn; backwards in the same order over the chunks reversed.
  forwards = [(((i // k) % v) * k + device, (i // (k * v)) * k + i % k) for i in range(v * m_all)]
  backwards = [((v - 1 - (i // k) % v) * k + device, m) for i, (_, m) in enumerate(forwards)]
  warmup = min(k - device - 1 if v == 1 else 2 * (k - device - 1) + (v - 1) * k, v * m_all)
  out = [("F", *u) for u in forwards[:warmup]]
  for f, b in zip(forwards[warmup:], backwards):
    out += [("F", *f), ("B", *b)]
  return out + [("B", *u) for u in backwards[v * m_all - warmup:]]


def timetable(stages: int, microbatches: int, virtual: int = 1,
              schedule=None) -> List[List[Unit]]:
  """Each device's unit (or None: idle) per slot, when every F and B takes one slot.

  A unit runs in the first slot after its device's previous unit and after
  what it needs: F(c, m) the forward F(c-1, m), B(c, m) the backward
  B(c+1, m) (the last chunk: its own forward). The orders are 1F1B's
  (interleaved for `virtual` > 1), or `schedule.order(stages, microbatches, k)`'s.
  """
  orders = [order(stages, microbatches, virtual, k) if schedule is None else
            schedule.order(stages, microbatches, k) for k in range(stages)]
  last, done, rows = virtual * stages - 1, {}, [[] for _ in orders]
  while any(len(o) for o in orders):
    ran = []
    for k, units in enumerate(orders):
      unit = units[0] if units else None
      if unit is not None:
        kind, c, m = unit
        needs = [("F", c - 1, m)] if kind == "F" and c else []
        if kind == "B":
          needs = [("F", c, m)] if c == last else [("B", c + 1, m)]
        if not all(u in done for u in needs):
          unit = None
      rows[k].append(unit)
      if unit is not None:
        ran.append(units.pop(0))
    if not ran:
      raise RuntimeError(f"the schedule deadlocks at K={stages}, M={microbatches}, v={virtual}")
    done.update(dict.fromkeys(ran))
  return rows


def draw(stages: int, microbatches: int, virtual: int = 1) -> str:
  """The timetable as tfpar.parallel.schedules' docstring shows it ("F21": chunk 2's forward of
  micro-batch 1)."""
  return "\n".join(f"  dev {k} " + " ".join(" . " if u is None else f"{u[0]}{u[1]}{u[2]}"
                                             for u in row).rstrip(" .")
                   for k, row in enumerate(timetable(stages, microbatches, virtual)))
