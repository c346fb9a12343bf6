"""What tfpar.plan prints: the ranked plans as text or JSON, the formulas with numbers, a flagfile."""

import numpy as np

from tfpar.console import count
from tfpar.layout import placement as plan_lib
from tfpar.planner import cost, search

GIB = 2 ** 30


def schedule(row: dict) -> str:
  """gpipe, 1f1b or interleaved x v; '-' without a pipeline."""
  if row["pipeline_stages"] == 1:
    return "-"
  name = row["pipeline_schedule"]
  return f"{name} x{row['virtual_stages']}" if name == "interleaved" else name


def degrees(row: dict) -> str:
  return (f"D={row['data_parallel']} x K={row['pipeline_stages']} x T={row['tensor_parallel']}, "
          f"{row['microbatches']} micro-batch{'es' if row['microbatches'] > 1 else ''} of "
          f"{row['microbatch_size']}, "
          f"remat {row['remat']}"
          + (f", {schedule(row)}" if row["pipeline_stages"] > 1 else "")
          + (f", optimizer {row['optimizer_sharding']}"
             if row["optimizer_sharding"] != "none" else "")
          + (", sequence parallel" if row.get("sequence_parallel") else ""))


def training_run(row: dict, cluster) -> str:
  """--train_tokens: the run's length, time, device-hours, energy and cost, in one line."""
  days = row["wall_seconds"] / 86400
  line = (f"  training run: {row['train_steps']:,.0f} steps, {days:,.1f} days wall-clock, "
          f"{row['device_hours']:,.0f} device-hours, {row['energy_kwh'] / 1000:,.1f} MWh "
          f"({cluster.power_watts:g} W per device x PUE {row['pue']:g})")
  if "cost" in row:
    line += f", cost {row['cost']:,.0f}"
  return line


def human(n: float) -> str:
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= scale:
      return f"{n / scale:.3g}{unit}"
  return f"{n:.0f}"


def _model_line(m, cluster, precision, system, global_batch) -> str:
  params = cost.stages(m, 1, 1, system).params.sum()
  return (f"model: {human(params)} parameters (L={m.num_layers}, d_model={m.d_model}, "
          f"heads={m.num_heads}, d_ff={m.d_ff}, seq {m.seq_len}, vocab {m.vocab_size}), "
          f"global batch {global_batch}, {precision}; cluster {cluster.name}: "
          f"{cluster.devices} x {cluster.memory_bytes / GIB:.0f} GiB, "
          f"{cluster.nodes} node(s) of {min(cluster.devices_per_node, cluster.devices)}; "
          f"layout: {system.name}")


def rejected(ranked: search.Ranked, top: int):
  """(row, reason) for the best plan of each D x K x T not shown, and faster plans that do not fit."""
  shown = set(ranked.order[:top].tolist())
  best = ranked.order[0]
  p = ranked.plans
  seen, out = set(), []
  for i in ranked.order:
    key = (p.D[i], p.K[i], p.T[i])
    if i in shown or key in seen:
      continue
    seen.add(key)
    out.append(i)
  faster_oom = [i for i in np.flatnonzero(~ranked.results["fits"])
                if ranked.results["step_seconds"][i] < ranked.results["step_seconds"][best]]
  if faster_oom:
    fastest = min(faster_oom, key=lambda i: ranked.results["step_seconds"][i])
    if fastest not in out[:top]:
      out.insert(0, fastest)
  return [(ranked.row(i), search.why_slower(ranked, i, best)) for i in out[:top]]


def text(m, cluster, ranked: search.Ranked, top: int, precision: str, system) -> str:
  g = int(round(ranked.results["M"][0] * ranked.plans.D[0] * ranked.plans.b[0]))
  lines = [_model_line(m, cluster, precision, system, g), "",
           f"{'#':>2}  {'D x K x T':<14}{'b x M':<10}{'remat':<10}{'schedule':<16}{'ZeRO':<6}"
           f"{'SP':<4}"
           f"{'GiB/dev':>8}"
           f"{'step s':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'bubble':>8}"]
  for n, i in enumerate(ranked.order[:top], 1):
    r = ranked.row(i)
    if not r["fits"]:
      break
    lines.append(
        f"{n:>2}  {r['data_parallel']} x {r['pipeline_stages']} x {r['tensor_parallel']:<6}"
        f"{str(r['microbatch_size']) + ' x ' + str(r['microbatches']):<10}"
        f"{r['remat']:<10}{schedule(r):<16}{r['optimizer_sharding']:<6}"
        f"{'on' if r['sequence_parallel'] else '-':<4}"
        f"{r['memory_bytes_per_device'] / GIB:>8.2f}"
        f"{r['step_seconds']:>10.4g}{r['tokens_per_second']:>12,.0f}"
        f"{r['tflops_per_device']:>9.1f}{r['mfu']:>7.1%}{r['bubble_fraction']:>8.1%}")
  best = ranked.row(ranked.order[0])
  mem = best["memory"]
  lines += ["", f"best: {degrees(best)}",
            "  memory per device: " + ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}"
                                                for k, v in mem.items()) +
            f" = {best['memory_bytes_per_device'] / GIB:.2f} GiB of "
            f"{cluster.memory_bytes / GIB:.0f}",
            "  step: " + ", ".join(f"{k.replace('_', ' ')} {v:.4g} s"
                                   for k, v in best["time"].items()) +
            f" = {best['step_seconds']:.4g} s"]
  uneven = uneven_stages(m, best, system)
  if uneven:
    lines.append(uneven)
  if "wall_seconds" in best:
    lines.append(training_run(best, cluster))
  why = rejected(ranked, top)
  if why:
    lines += ["", "not chosen:"]
    lines += [f"  {degrees(r)}: {reason}" for r, reason in why]
  lines += ["", f"searched {count(len(ranked.plans), 'plan')} "
            f"({int(ranked.results['fits'].sum()):,} fit) in {ranked.seconds:.2f} s"]
  return "\n".join(lines)


def uneven_stages(m, row: dict, system) -> str:
  """A line for a layout of L/K blocks per stage whose K does not divide L: its stage sizes,
  and which runtimes run it; '' otherwise."""
  k = row["pipeline_stages"]
  if not system.uniform_stages or m.num_layers % k == 0:
    return ""
  blocks = plan_lib.even_stages(m.num_layers, k)
  small = min(blocks)
  sizes = ", ".join(f"{b}" if n == 1 else f"{b} x {n}" for b, n in _runs(blocks))
  return (f"  stages: {sizes} blocks ({k} stages do not divide {m.num_layers} blocks; the "
          f"{blocks.count(small)} of {small} at the ends): Megatron-LM refuses this layout "
          f"(its --num-layers must be a multiple of --pipeline-model-parallel-size); "
          f"Megatron-DeepSpeed runs it, and tfpar.train as --stage_layers="
          f"{','.join(str(b) for b in blocks)}")


def _runs(values):
  """(value, how many in a row) of a sequence."""
  out = []
  for x in values:
    if out and out[-1][0] == x:
      out[-1][1] += 1
    else:
      out.append([x, 1])
  return out


def to_json(m, cluster, ranked: search.Ranked, top: int, precision: str, system) -> dict:
  return {"cluster": cluster.name, "system": system.name, "precision": precision,
          "model": {"num_layers": m.num_layers, "d_model": m.d_model, "num_heads": m.num_heads,
                    "d_ff": m.d_ff, "seq_len": m.seq_len, "vocab_size": m.vocab_size},
          "searched": len(ranked.plans), "search_seconds": ranked.seconds,
          "plans": [ranked.row(i) for i in ranked.order[:top] if ranked.results["fits"][i]],
          "rejected": [{**r, "reason": reason} for r, reason in rejected(ranked, top)]}


def _tfpar_activations(m, p, act) -> str:
  """The tfpar count of one block's activations (tfpar.layout.placement) with the plan's numbers."""
  s, b, h, a, T = m.seq_len, p["microbatch_size"], m.d_model, m.num_heads, p["tensor_parallel"]
  n = float(plan_lib.tfpar_kept_per_position(m, T, p["sequence_parallel"]))
  core = {"none": f" + {a}*{s}/{T}", "selective": "", "full": None}[p["remat"]]
  if core is None:
    return f"sbh x act = {s}*{b}*{h}*{act} (full recompute: the block's input)"
  return (f"sb(N{' + as/T' if core else ''}) x act = {s}*{b}*({n:g}{core})*{act} (N = values "
          f"kept per position, {'sequence parallel' if p['sequence_parallel'] else 'not split'})")


def explain(m, cluster, ranked: search.Ranked, precision: str, system) -> str:
  """The cost model's formulas with the best plan's numbers in them."""
  i = ranked.order[0]
  r, p = ranked.results, ranked.row(i)
  D, K, T, b, M, v = (p["data_parallel"], p["pipeline_stages"], p["tensor_parallel"],
                      p["microbatch_size"], p["microbatches"], p["virtual_stages"])
  rc = int(p["remat"] == "full")
  # Of the block's s b h 34, what stays whole on a shard's device (cost's module docstring).
  regather = p["sequence_parallel"] and system.regather
  w = (0 if regather else 4) if p["sequence_parallel"] else 10
  s, h, f, a, L, V = m.seq_len, m.d_model, m.d_ff, m.num_heads, m.num_layers, m.vocab_size
  g = D * b * M
  act = cost.ACTIVATION_BYTES[precision]
  peak = cluster.peak_flops[cost.COMPUTE_DTYPE[precision]]
  e = cluster.efficiency
  bpp = (system.weight_bytes[precision], system.grad_bytes[precision],
         system.optimizer_bytes[precision])
  grads_held = round(r["gradients"][i] / bpp[1] / (r["weights"][i] / bpp[0]), 6)  # x its weights
  sharded = p["optimizer_sharding"] != "none"
  lines = [
      "", "how the best plan's numbers come about (docs/planner.md has the sources):",
      f"  layer FLOPs/sequence = 2s(4h^2 + 2hf) + 4s^2h = 2*{s}*(4*{h}^2 + 2*{h}*{f}) + "
      f"4*{s}^2*{h} = {cost.layer_flops(m):.4g}",
      f"  logits FLOPs/sequence = 2shV = 2*{s}*{h}*{V} = {cost.logits_flops(m):.4g}",
      f"  step FLOPs = G((3 + r)L layer + qL 4s^2h + 3 logits) = {g}*((3 + {rc})*{L}*layer + "
      f"{int(p['remat'] == 'selective')}*{L}*4*{s}^2*{h} + 3*logits) = "
      f"{cost.step_flops(m, g, p['remat']):.4g}",
      f"  parameters on the device holding most = {r['params_per_device'][i]:,.0f}; "
      f"bytes/parameter = weights {bpp[0]} + gradients {bpp[1]}"
      + (f" x {grads_held:.3g}" if grads_held != 1 else "")
      + f" + optimizer {bpp[2]}" + (f"/D={D}" if sharded else "")
      + f" ({p['optimizer_sharding']}) -> "
      f"{(r['weights'][i] + r['gradients'][i] + r['optimizer'][i]) / GIB:.3f} GiB",
      "  activations per block and micro-batch = " + (_tfpar_activations(m, p, act)
      if system.activation_counts == "tfpar" else {"full": f"2sbh{'/T' if regather else ''} x {act}/2 = "
                 f"2*{s}*{b}*{h}{f'/{T}' if regather else ''}*{act / 2:g}",
         "selective": f"sbh(W + (34-W)/T) x {act}/2 = {s}*{b}*{h}*({w} + {34 - w}/{T})"
                      f"*{act / 2:g}",
         "none": f"sbh(W + (34-W)/T + 5as/(hT)) x {act}/2 = {s}*{b}*{h}*({w} + {34 - w}/{T} + "
                 f"5*{a}*{s}/({h}*{T}))*{act / 2:g}"}[p["remat"]]
      + f" (W = {w}: {'sequence parallel' if p['sequence_parallel'] else 'not split'})")
      + f"; {IN_FLIGHT[p['pipeline_schedule']]} micro-batches in flight on stage k "
      f"({p['pipeline_schedule']}) -> activations {p['memory']['activations'] / GIB:.3f} GiB",
      f"  efficiency = e_max / (1 + w/(h/T) + r0/(bs)) = {e.max_efficiency} / (1 + "
      f"{e.width_half}/{h / T:g} + {e.rows_half}/{b * s}) = {r['efficiency'][i]:.3f} of "
      f"{peak / 1e12:g} TFLOP/s",
      f"  bubble = (K-1)/(vM+K-1) = {K - 1}/({v}*{M}+{K - 1}) = {p['bubble_fraction']:.1%} -> "
      f"{p['time']['bubble']:.4g} s",
      f"  tensor all-reduce per sub-block = 2(T-1)/T n/bw + 2(T-1) lat, n = bsh x {act} B = "
      f"{b * s * h * act:,} B, {4 + 2 * rc} per block -> {p['time']['tensor_comm']:.4g} s per step",
      f"  pipeline send per micro-batch = "
      f"{'n/T/bw + lat + all-gather in the node' if system.scatter_gather else 'n/bw + lat'}, "
      f"twice (activation, gradient), v={v} "
      f"times, on the {'inter' if K * T > cluster.devices_per_node else 'intra'}-node link "
      f"(K x T = {K * T} devices, {cluster.devices_per_node} per node) -> "
      f"{p['time']['pipeline_comm']:.4g} s",
      f"  data {DATA_EXCHANGE[sharded and system.sharding_all_reduces]}, "
      f"n = {r['params_per_device'][i]:,.0f} x {bpp[1]} B over D={D}"
      + (", + the tied embedding's gradient all-reduced between the first and last stage"
         if K > 1 and (system.vocab_parallel or cost.one_program_per_worker(system, cluster, K, T))
         else "") + f" -> {p['time']['data_comm']:.4g} s",
      f"  step = M x slot + (K-1) x (slot/v + send) + data exchange = {p['step_seconds']:.4g} s; "
      f"TFLOP/s per device = step FLOPs / step / {D * K * T} = {p['tflops_per_device']:.2f}; "
      f"MFU = G(3 L layer + 3 logits) / step / devices / peak = {p['mfu']:.1%}",
  ]
  if "wall_seconds" in p:
    lines.append(
        f"  training run: steps = ceil(tokens / (G s)) = {p['train_steps']:,.0f}; wall = steps x "
        f"step = {p['wall_seconds']:,.0f} s; device-hours = {D * K * T} x wall / 3600 = "
        f"{p['device_hours']:,.0f}; energy = device-hours x {cluster.power_watts:g} W x PUE "
        f"{p['pue']:g} = "
        f"{p['energy_kwh']:,.0f} kWh" + (f"; cost = device-hours x price = {p['cost']:,.0f}"
                                         if "cost" in p else ""))
  return "\n".join(lines)


# The data-parallel exchange's formula, by whether a sharded step all-gathers the new weights
# after its all-reduce (tfpar); w = n in tfpar.
DATA_EXCHANGE = {
    False: "all-reduce = 2(D-1)/D n/bw + 2(D-1) lat",
    True: "all-reduce + all-gather of the new weights = 3(D-1)/D n/bw + 3(D-1) lat",
}
IN_FLIGHT = {"gpipe": "M", "1f1b": "min(M, K-k)", "interleaved": "(2(K-k-1) + (v-1)K + 1)/v"}


def workers(row: dict, cluster) -> tuple:
  """(worker processes, devices each) that run this plan; (1, N) inside one node or on TPUs.

  Across nodes a worker holds one replica where its K x T devices divide a node,
  else a node's devices, with pipeline stages on different workers.
  """
  n = row["data_parallel"] * row["pipeline_stages"] * row["tensor_parallel"]
  if cluster.kind == "tpu" or n <= cluster.devices_per_node:
    return 1, n
  kt = row["pipeline_stages"] * row["tensor_parallel"]
  per = kt if cluster.devices_per_node % kt == 0 else cluster.devices_per_node
  return n // per, per


def plan_flags(row: dict, cluster, schedule_flags: bool = True) -> list:
  """The tfpar.train flags that run this plan on this cluster.

  `schedule_flags`: write --pipeline_schedule and --virtual_stages (False where
  tfpar.train does not define them yet, and the plan is GPipe).
  """
  d, k, t, mb = row["data_parallel"], row["pipeline_stages"], row["tensor_parallel"], \
      row["microbatches"]
  n_workers, per_worker = workers(row, cluster)
  out = [f"--global_batch_size={d * row['microbatch_size'] * mb}"]
  zero3 = row["optimizer_sharding"] == "zero3"  # Recomputes every block: no --remat.
  model_parallel = k > 1 or t > 1 or mb > 1 or (row["remat"] != "none" and not zero3)
  if cluster.kind == "tpu":
    out.append("--strategy=tpu")
  elif n_workers > 1:
    out.append("--strategy=multi_worker_mirrored")
  else:
    out.append("--strategy=mirrored" if d > 1 else "--strategy=one_device")
  if cluster.kind == "cpu" and per_worker > 1:
    out.append(f"--num_cpu_devices={per_worker}")
  if model_parallel:
    out += [f"--data_parallel={d}", f"--pipeline_stages={k}", f"--tensor_parallel={t}",
            f"--microbatches={mb}", f"--remat={row['remat']}"]
  if row["optimizer_sharding"] != "none":
    out.append(f"--optimizer_sharding={row['optimizer_sharding']}")
  if row.get("sequence_parallel"):
    out.append("--sequence_parallel")
  if k > 1 and schedule_flags:
    out += [f"--pipeline_schedule={row['pipeline_schedule']}",
            f"--virtual_stages={row['virtual_stages']}"]
  return out


def write_flagfile(path: str, given, row: dict, cluster, schedule_flags: bool = True) -> str:
  """The user's training flags as given (`--name=value` lines), then the plan's, as a flagfile."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  # gfile: gs:// works too.
  n_workers, per_worker = workers(row, cluster)
  header = [f"# Written by python -m tfpar.plan for {cluster.name}: {degrees(row)}.",
            f"# Predicted: {row['memory_bytes_per_device'] / GIB:.2f} GiB per device, "
            f"{row['step_seconds']:.4g} s per step, {row['tokens_per_second']:,.0f} tokens/s."]
  if n_workers > 1:
    header.append(f"# Launch {count(n_workers, 'worker')} (TF_CONFIG), each with "
                  f"{count(per_worker, 'device')}"
                  + ("; pipeline stages span workers." if per_worker != row["pipeline_stages"] *
                     row["tensor_parallel"] else "."))
  with tf.io.gfile.GFile(path, "w") as f:
    f.write("\n".join(header + list(given) + plan_flags(row, cluster, schedule_flags)) + "\n")
  return path
