"""Effective training time (ETTR): a trace-driven model and a soak drill with real faults.

- :mod:`trainguard.drill.trace`: fault traces (the public StepFun trace, a Llama-3-like rate, synthetic ones),
  classified into the fault classes trainguard reacts to, and scaled to a job's size.
- :mod:`trainguard.drill.components`: the component times of a fault-tolerance system (checkpoint stall,
  detection latency per fault class, recovery time per level, ...) for trainguard and a torchrun-like baseline.
- :mod:`trainguard.drill.ettr`: replays a trace against a job and reports ETTR, and the checkpoint interval
  that maximises it next to Young/Daly's analytic optimum.
- :mod:`trainguard.drill.plot`: ETTR over time and the fault timeline as a PNG.
- :mod:`trainguard.drill.soak`: the soak drill, a real training job under ``trainguard run`` with faults
  injected on a schedule drawn from the trace.
"""
