"""What tfpar.plan prints: the ranked plans as text or JSON, the formulas with numbers, a flagfile."""

import numpy as np

from tfpar.console import count
from tfpar.planner import cost, search

GIB = 2 ** 30


def degrees(row: dict) -> str:
  return (f"D={row['data_parallel']} x K={row['pipeline_stages']} x T={row['tensor_parallel']}, "
          f"{row['microbatches']} micro-batch{'es' if row['microbatches'] > 1 else ''} of "
          f"{row['microbatch_size']}, "
          f"remat {'on' if row['remat'] else 'off'}")


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
          f"layout: {system.name} ({system.schedule})")


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
           f"{'#':>2}  {'D x K x T':<14}{'b x M':<10}{'remat':<6}{'GiB/dev':>8}{'step s':>10}"
           f"{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'bubble':>8}"]
  for n, i in enumerate(ranked.order[:top], 1):
    r = ranked.row(i)
    if not r["fits"]:
      break
    lines.append(
        f"{n:>2}  {r['data_parallel']} x {r['pipeline_stages']} x {r['tensor_parallel']:<6}"
        f"{str(r['microbatch_size']) + ' x ' + str(r['microbatches']):<10}"
        f"{'on' if r['remat'] else 'off':<6}{r['memory_bytes_per_device'] / GIB:>8.2f}"
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
  why = rejected(ranked, top)
  if why:
    lines += ["", "not chosen:"]
    lines += [f"  {degrees(r)}: {reason}" for r, reason in why]
  return "\n".join(lines)


def to_json(m, cluster, ranked: search.Ranked, top: int, precision: str, system) -> dict:
  return {"cluster": cluster.name, "system": system.name, "precision": precision,
          "model": {"num_layers": m.num_layers, "d_model": m.d_model, "num_heads": m.num_heads,
                    "d_ff": m.d_ff, "seq_len": m.seq_len, "vocab_size": m.vocab_size},
          "plans": [ranked.row(i) for i in ranked.order[:top] if ranked.results["fits"][i]],
          "rejected": [{**r, "reason": reason} for r, reason in rejected(ranked, top)]}


def explain(m, cluster, ranked: search.Ranked, precision: str, system) -> str:
  """The cost model's formulas with the best plan's numbers in them."""
  i = ranked.order[0]
  r, p = ranked.results, ranked.row(i)
  D, K, T, b, M = (p["data_parallel"], p["pipeline_stages"], p["tensor_parallel"],
                   p["microbatch_size"], p["microbatches"])
  rc = int(p["remat"])
  s, h, f, a, L, V = m.seq_len, m.d_model, m.d_ff, m.num_heads, m.num_layers, m.vocab_size
  g = D * b * M
  act = cost.ACTIVATION_BYTES[precision]
  peak = cluster.peak_flops[cost.COMPUTE_DTYPE[precision]]
  e = cluster.efficiency
  bpp = (system.weight_bytes[precision], system.grad_bytes[precision],
         system.optimizer_bytes[precision])
  lines = [
      "", "how the best plan's numbers come about (docs/planner.md has the sources):",
      f"  layer FLOPs/sequence = 2s(4h^2 + 2hf) + 4s^2h = 2*{s}*(4*{h}^2 + 2*{h}*{f}) + "
      f"4*{s}^2*{h} = {cost.layer_flops(m):.4g}",
      f"  logits FLOPs/sequence = 2shV = 2*{s}*{h}*{V} = {cost.logits_flops(m):.4g}",
      f"  step FLOPs = G((3 + r)L layer + 3 logits) = {g}*((3 + {rc})*{L}*layer + 3*logits) = "
      f"{cost.step_flops(m, g, bool(rc)):.4g}",
      f"  parameters on the device holding most = {r['params_per_device'][i]:,.0f}; "
      f"bytes/parameter = weights {bpp[0]} + gradients {bpp[1]} + optimizer {bpp[2]} = "
      f"{sum(bpp)} -> {r['params_per_device'][i] * sum(bpp) / GIB:.3f} GiB",
      f"  activations per block and micro-batch = "
      + (f"2sbh x {act}/2 = 2*{s}*{b}*{h}*{act / 2:g}" if rc else
         f"sbh(10 + 24/T + 5as/(hT)) x {act}/2 = {s}*{b}*{h}*(10 + 24/{T} + 5*{a}*{s}/({h}*{T}))"
         f"*{act / 2:g}")
      + f"; {'M' if system.schedule == 'gpipe' else 'min(M, K)'} micro-batches in flight "
      f"({system.schedule}) -> activations {p['memory']['activations'] / GIB:.3f} GiB",
      f"  efficiency = e_max / (1 + w/(h/T) + r0/(bs)) = {e.max_efficiency} / (1 + "
      f"{e.width_half}/{h / T:g} + {e.rows_half}/{b * s}) = {r['efficiency'][i]:.3f} of "
      f"{peak / 1e12:g} TFLOP/s",
      f"  bubble = (K-1)/(M+K-1) = {K - 1}/{M + K - 1} = {p['bubble_fraction']:.1%} -> "
      f"{p['time']['bubble']:.4g} s",
      f"  tensor all-reduce per sub-block = 2(T-1)/T n/bw + 2(T-1) lat, n = bsh x {act} B = "
      f"{b * s * h * act:,} B, {4 + 2 * rc} per block -> {p['time']['tensor_comm']:.4g} s per step",
      f"  pipeline send per micro-batch = n/bw + lat, twice (activation, gradient) -> "
      f"{p['time']['pipeline_comm']:.4g} s",
      f"  data all-reduce = 2(D-1)/D n/bw + 2(D-1) lat, n = {r['params_per_device'][i]:,.0f} x "
      f"{bpp[1]} B over D={D} -> {p['time']['data_comm']:.4g} s",
      f"  step = M x slot + (K-1) x slot + data all-reduce = {p['step_seconds']:.4g} s; "
      f"TFLOP/s per device = step FLOPs / step / {D * K * T} = {p['tflops_per_device']:.2f}; "
      f"MFU = G(3 L layer + 3 logits) / step / devices / peak = {p['mfu']:.1%}",
  ]
  return "\n".join(lines)


def plan_flags(row: dict, cluster) -> list:
  """The tfpar.train flags that run this plan on this cluster."""
  d, k, t, mb = row["data_parallel"], row["pipeline_stages"], row["tensor_parallel"], \
      row["microbatches"]
  n = d * k * t
  out = [f"--global_batch_size={d * row['microbatch_size'] * mb}"]
  model_parallel = k > 1 or t > 1 or mb > 1 or row["remat"]
  if cluster.kind == "tpu":
    out.append("--strategy=tpu")
  elif n > cluster.devices_per_node:
    out.append("--strategy=multi_worker_mirrored")  # One worker per replica (K x T devices).
  else:
    out.append("--strategy=mirrored" if d > 1 else "--strategy=one_device")
  if cluster.kind == "cpu" and (k * t if n > cluster.devices_per_node else n) > 1:
    out.append(f"--num_cpu_devices={k * t if n > cluster.devices_per_node else n}")
  if model_parallel:
    out += [f"--data_parallel={d}", f"--pipeline_stages={k}", f"--tensor_parallel={t}",
            f"--microbatches={mb}", "--remat" if row["remat"] else "--noremat"]
  return out


def write_flagfile(path: str, given, row: dict, cluster) -> str:
  """The user's training flags as given (`--name=value` lines), then the plan's, as a flagfile."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  # gfile: gs:// works too.
  n = row["data_parallel"] * row["pipeline_stages"] * row["tensor_parallel"]
  header = [f"# Written by python -m tfpar.plan for {cluster.name}: {degrees(row)}.",
            f"# Predicted: {row['memory_bytes_per_device'] / GIB:.2f} GiB per device, "
            f"{row['step_seconds']:.4g} s per step, {row['tokens_per_second']:,.0f} tokens/s."]
  if cluster.kind != "tpu" and n > cluster.devices_per_node:
    header.append(f"# Launch {count(row['data_parallel'], 'worker')} (TF_CONFIG), each with "
                  f"{count(row['pipeline_stages'] * row['tensor_parallel'], 'device')}.")
  with tf.io.gfile.GFile(path, "w") as f:
    f.write("\n".join(header + list(given) + plan_flags(row, cluster)) + "\n")
  return path
