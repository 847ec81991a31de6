"""Synthetic problems for tests and benchmarks: chains, residual networks, random DAGs, GPT-like blocks.

Costs are plausible, not measured: times follow FLOP counts of convolutional
networks at a small batch, bytes follow activation shapes in float32. Each
family offers the storage variants that make implementation choice matter:

* ReLU: "default" keeps its output; "bitmask" keeps a 1-bit mask (output/32)
  and nothing else, slightly slower backward.
* BatchNorm: "default" keeps its input; "output_activated" keeps its output
  plus a small state, slightly slower backward.
* max-pool: "default" keeps its input plus int64 indices; "packed" keeps only
  packed indices (output/4), slower.
* conv: "default" (fast, workspace) and "low_workspace" (slower, no workspace).

Everything is deterministic in `seed`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from solver.problem import Impl, Node, Problem, Restore, storage_bytes

F32 = 4


class _Builder:
    def __init__(self, seed: int, name: str) -> None:
        self.rng = random.Random(seed)
        self.nodes: list[Node] = []
        self.name = name
        self.seed = seed

    def jitter(self, x: float) -> float:
        return x * self.rng.uniform(0.85, 1.15)

    def add(self, name: str, op: str, inputs, out_bytes: int, impls, **kw) -> str:
        kw.setdefault("grad_bytes", out_bytes)
        kw.setdefault("requires_backward", True)
        self.nodes.append(
            Node(name=name, op=op, inputs=tuple(inputs), output_bytes=out_bytes, impls=tuple(impls), **kw)
        )
        return name

    # -- op families ----------------------------------------------------------
    def conv(self, name, x, out_elems, cin, cout, k=3):
        """x=None: the conv reads the model input (not a node) and keeps nothing of ours."""
        flops = 2.0 * out_elems * cin * k * k
        t = self.jitter(flops / 20e9 + 2e-5)
        ws = int(out_elems * F32 * 0.5)
        keeps = (0,) if x is not None else ()
        impls = [
            Impl("default", t, 2.0 * t, fwd_workspace=ws, bwd_workspace=ws, keeps_inputs=keeps),
            Impl("low_workspace", 1.35 * t, 2.6 * t, keeps_inputs=keeps),
        ]
        inputs = [x] if x is not None else []
        return self.add(
            name, "conv2d", inputs, out_elems * F32, impls, param_grad_bytes=cin * cout * k * k * F32
        )

    def bn(self, name, x, elems, channels):
        t = self.jitter(elems / 2e9 + 1e-5)
        small = 2 * channels * F32
        impls = [
            Impl("default", t, 2.0 * t, keeps_inputs=(0,), state_bytes=small),
            Impl("output_activated", t, 2.3 * t, keeps_output=True, state_bytes=2 * small, grad_in_place=0),
        ]
        return self.add(name, "batch_norm", [x], elems * F32, impls, param_grad_bytes=small)

    def relu(self, name, x, elems):
        t = self.jitter(elems / 4e9 + 5e-6)
        impls = [
            Impl("default", t, t, keeps_output=True, fwd_in_place=0),
            Impl("bitmask", 1.1 * t, 1.2 * t, state_bytes=max(1, elems * F32 // 32), grad_in_place=0),
        ]
        return self.add(name, "relu", [x], elems * F32, impls)

    def add_op(self, name, a, b, elems):
        t = self.jitter(elems / 3e9 + 5e-6)
        # as torch's: the output's gradient is handed to both arguments, and the sum may be
        # written into the first argument
        impl = Impl("default", t, 0.5 * t, grad_in_place=0, grad_shared=(1,), fwd_in_place=0)
        return self.add(name, "add", [a, b], elems * F32, [impl])

    def maxpool(self, name, x, out_elems):
        t = self.jitter(out_elems * 9 / 4e9 + 1e-5)
        impls = [
            Impl("default", t, 1.5 * t, keeps_inputs=(0,), state_bytes=out_elems * 8),
            Impl("packed", 1.2 * t, 2.0 * t, state_bytes=max(1, out_elems)),
        ]
        return self.add(name, "max_pool2d", [x], out_elems * F32, impls)

    def head(self, x, elems, channels, classes, batch):
        t = self.jitter(elems / 4e9 + 5e-6)
        pooled = batch * channels
        p = self.add("avgpool", "adaptive_avg_pool2d", [x], pooled * F32, [Impl("default", t, t)])
        f = self.add(
            "flatten",
            "flatten",
            [p],
            0,
            [Impl("default", 1e-6, 1e-6)],
            alias_of=0,
            grad_bytes=pooled * F32,
        )
        tl = self.jitter(2.0 * pooled * classes / 20e9 + 1e-5)
        fc = self.add(
            "fc",
            "linear",
            [f],
            batch * classes * F32,
            [Impl("default", tl, 2 * tl, keeps_inputs=(0,))],
            param_grad_bytes=channels * classes * F32,
        )
        return self.add(
            "loss",
            "cross_entropy",
            [fc],
            F32,
            [Impl("default", 1e-5, 1e-5, keeps_inputs=(0,), state_bytes=batch * F32)],
            is_output=True,
        )

    def problem(self, **meta) -> Problem:
        fp = hashlib.sha256(f"{self.name}:{self.seed}:{len(self.nodes)}".encode()).hexdigest()
        return Problem(
            nodes=tuple(self.nodes),
            fingerprint=fp,
            fixed_bytes=meta.pop("fixed_bytes", 0),
            meta={"synthetic": self.name, "seed": self.seed, **meta},
        )


def chain(n: int = 10, seed: int = 0, batch: int = 8, hw: int = 32, channels: int = 16) -> Problem:
    """A plain chain of about `n` nodes: conv-bn-relu repeated, ending in a loss."""
    if n < 4:
        raise ValueError("chain needs n >= 4")
    b = _Builder(seed, f"chain{n}")
    elems = batch * channels * hw * hw
    x = None
    cin = 3
    i = 0
    body = n - 1
    kinds = ["conv", "bn", "relu"]
    while i < body:
        kind = kinds[i % 3]
        name = f"{kind}{i}"
        if kind == "conv":
            x = b.conv(name, x, elems, cin if x is None else channels, channels)
        elif kind == "bn":
            x = b.bn(name, x, elems, channels)
        else:
            x = b.relu(name, x, elems)
        i += 1
    b.add(
        "loss",
        "mse_loss",
        [x],
        F32,
        [Impl("default", b.jitter(elems / 4e9), b.jitter(elems / 4e9), keeps_inputs=(0,))],
        is_output=True,
    )
    return b.problem()


def resnet(
    n: int = 100, seed: int = 0, batch: int = 8, hw: int = 224, bottleneck: bool | None = None
) -> Problem:
    """A ResNet-like residual DAG with about `n` nodes (50-350 are typical).

    Stem conv-bn-relu-maxpool, then residual blocks in four stages (spatial size
    halves, channels double; the first block of each stage has a conv-bn projection
    shortcut, the first stage expands the stem's channels 4x so the blocks, not the
    stem, hold most of the memory), then avgpool-flatten(view)-linear-loss.
    """
    if bottleneck is None:
        bottleneck = n >= 150
    b = _Builder(seed, f"resnet{n}")
    ch = 16
    s = hw // 2
    e = batch * ch * s * s
    x = b.conv("stem_conv", None, e, 3, ch, k=7)
    x = b.bn("stem_bn", x, e, ch)
    x = b.relu("stem_relu", x, e)
    s //= 2
    e = batch * ch * s * s
    x = b.maxpool("stem_pool", x, e)
    per_block = 10 if bottleneck else 8
    n_blocks = max(1, (n - 8) // per_block)
    stage_blocks = [n_blocks // 4 + (1 if k < n_blocks % 4 else 0) for k in range(4)]
    blk = 0
    for st, nb in enumerate(stage_blocks):
        for j in range(nb):
            down = j == 0  # projection shortcut (stage 0: channel expansion only)
            cin = ch
            if down and st == 0:
                ch *= 4
            elif down:
                ch *= 2
                s = max(1, s // 2)
            e_out = batch * ch * s * s
            p = f"b{blk}_"
            if bottleneck:
                mid = max(4, ch // 4)
                e_mid = batch * mid * s * s
                y = b.conv(p + "conv1", x, e_mid, cin, mid, k=1)
                y = b.bn(p + "bn1", y, e_mid, mid)
                y = b.relu(p + "relu1", y, e_mid)
                y = b.conv(p + "conv2", y, e_mid, mid, mid, k=3)
                y = b.bn(p + "bn2", y, e_mid, mid)
                y = b.relu(p + "relu2", y, e_mid)
                y = b.conv(p + "conv3", y, e_out, mid, ch, k=1)
                y = b.bn(p + "bn3", y, e_out, ch)
            else:
                y = b.conv(p + "conv1", x, e_out, cin, ch)
                y = b.bn(p + "bn1", y, e_out, ch)
                y = b.relu(p + "relu1", y, e_out)
                y = b.conv(p + "conv2", y, e_out, ch, ch)
                y = b.bn(p + "bn2", y, e_out, ch)
            if down:
                sc = b.conv(p + "down_conv", x, e_out, cin, ch, k=1)
                sc = b.bn(p + "down_bn", sc, e_out, ch)
            else:
                sc = x
            y = b.add_op(p + "add", y, sc, e_out)
            x = b.relu(p + "relu_out", y, e_out)
            blk += 1
    b.head(x, batch * ch * s * s, ch, 10, batch)
    return b.problem()


def transformer(layers: int = 2, seed: int = 0, batch: int = 4, seq: int = 64, dim: int = 64) -> Problem:
    """A GPT-like stack of `layers` pre-norm blocks (costs shaped like the profiled GPT's).

    Per block: layer norm, a qkv linear whose output is split into three views (q, k, v),
    each transposed (another view), attention reading the three views (default keeps them
    and its output; "math" keeps a large private state instead), a transposed view of its
    output, projection, dropout (mask or bitmask state), residual add (gradient in place),
    then layer norm, linear, gelu, linear, dropout, residual add. Ends in a layer norm and
    a linear head (the output).
    """
    b = _Builder(seed, f"transformer{layers}")
    e = batch * seq * dim
    act = e * F32
    heads = 4
    scores = batch * heads * seq * seq * F32

    def lin(name, x, out_elems, fan_in):
        t = b.jitter(2.0 * out_elems * fan_in / 20e9 + 1e-5)
        return b.add(
            name,
            "linear",
            [x],
            out_elems * F32,
            [Impl("default", t, 2 * t, keeps_inputs=(0,))],
            param_grad_bytes=fan_in * (out_elems // (batch * seq)) * F32,
        )

    def ln(name, x):
        t = b.jitter(e / 2e9 + 1e-5)
        impls = [
            Impl(
                "default",
                t,
                1.6 * t,
                bwd_workspace=2 * dim * F32,
                keeps_inputs=(0,),
                state_bytes=batch * seq * 8,
            )
        ]
        return b.add(name, "layernorm", [x], act, impls, param_grad_bytes=2 * dim * F32)

    def view(name, op, x, grad_bytes):
        return b.add(name, op, [x], 0, [Impl("default", 1e-6, 1e-6)], alias_of=0, grad_bytes=grad_bytes)

    def dropout(name, x):
        t = b.jitter(e / 4e9 + 5e-6)
        impls = [
            Impl("default", t, t, state_bytes=act),
            Impl(
                "mask_bitmask",
                1.2 * t,
                1.3 * t,
                fwd_workspace=act,
                bwd_workspace=act,
                state_bytes=max(1, act // 32),
            ),
        ]
        return b.add(name, "dropout", [x], act, impls)

    def add(name, x, y):
        t = b.jitter(e / 3e9 + 5e-6)
        return b.add(name, "add", [x, y], act, [Impl("default", t, 3 * t, grad_in_place=0)])

    t_emb = b.jitter(e / 4e9 + 1e-5)
    x = b.add("tok", "embedding", [], act, [Impl("default", t_emb, 4 * t_emb)], param_grad_bytes=act // 4)
    for k in range(layers):
        p = f"b{k}_"
        h = ln(p + "ln1", x)
        qkv = lin(p + "qkv", h, 3 * e, dim)
        sp = view(p + "split", "split", qkv, 3 * act)
        qs = [view(p + f"t{c}", "transpose", view(p + c, "getitem", sp, act), act) for c in "qkv"]
        t = b.jitter(batch * heads * seq * seq * dim / 20e9 + 2e-5)
        impls = [
            Impl(
                "default",
                t,
                2.5 * t,
                fwd_workspace=scores // 8,
                bwd_workspace=scores,
                keeps_inputs=(0, 1, 2),
                keeps_output=True,
                state_bytes=batch * heads * seq * 8,
            ),
            Impl(
                "math", 1.4 * t, 2.0 * t, fwd_workspace=scores, bwd_workspace=scores, state_bytes=2 * scores
            ),
        ]
        a = b.add(p + "attn", "scaled_dot_product_attention", qs, act, impls)
        a = view(p + "merge", "transpose", a, act)
        y = dropout(p + "attn_drop", lin(p + "proj", a, e, dim))
        x = add(p + "add1", x, y)
        h = ln(p + "ln2", x)
        f = lin(p + "fc", h, 4 * e, dim)
        tg = b.jitter(4 * e / 4e9 + 5e-6)
        g = b.add(p + "gelu", "gelu", [f], 4 * act, [Impl("default", tg, 2 * tg, keeps_inputs=(0,))])
        y = dropout(p + "drop", lin(p + "out", g, e, 4 * dim))
        x = add(p + "add2", x, y)
    x = ln("ln_f", x)
    th = b.jitter(2.0 * e * 256 / 20e9 + 1e-5)
    b.add(
        "head",
        "linear",
        [x],
        batch * seq * 256 * F32,
        [Impl("default", th, 2 * th, keeps_inputs=(0,))],
        is_output=True,
        param_grad_bytes=dim * 256 * F32,
    )
    return b.problem()


def random_dag(n: int = 8, seed: int = 0, views: bool = True, multi_output: bool = True) -> Problem:
    """A small random DAG with random costs and implementation variants.

    Node 0 reads the model input and has no backward (no parameters). Every node
    reaches the final loss, so every gradient is defined. Occasional views, a
    second output, nodes with several inputs.
    """
    rng = random.Random(seed)
    b = _Builder(seed, f"random{n}")
    names: list[str] = []
    needs_grad: dict[str, bool] = {}
    consumers: dict[str, int] = {}

    def impls_for(op: str) -> list[Impl]:
        t = rng.uniform(1e-4, 1e-3)
        bt = rng.uniform(1e-4, 2e-3)
        ws = rng.choice([0, 0, rng.randint(1, 40) * 1000])
        if op == "relu":
            return [
                Impl("default", t, bt, fwd_workspace=ws, keeps_output=True, fwd_in_place=0),
                Impl("bitmask", 1.1 * t, 1.2 * bt, state_bytes=rng.randint(1, 4) * 1000, grad_in_place=0),
            ]
        if op == "bn":
            return [
                Impl("default", t, bt, keeps_inputs=(0,), state_bytes=rng.randint(0, 2) * 1000),
                Impl(
                    "output_activated",
                    t,
                    1.3 * bt,
                    keeps_output=True,
                    state_bytes=rng.randint(1, 3) * 1000,
                    grad_in_place=0,
                ),
            ]
        return [
            Impl("default", t, bt, fwd_workspace=ws, bwd_workspace=rng.choice([0, ws]), keeps_inputs=(0,))
        ]

    first = b.add(
        "input_op",
        "normalize",
        [],
        rng.randint(5, 40) * 1000,
        impls_for("other"),
        requires_backward=False,
        grad_bytes=0,
    )
    b.nodes[-1] = Node(
        **{
            **b.nodes[-1].__dict__,
            "impls": tuple(
                Impl(i.name, i.fwd_time, 0.0, i.fwd_workspace, 0, (), False, 0) for i in b.nodes[-1].impls
            ),
        }
    )
    names.append(first)
    needs_grad[first] = False
    consumers[first] = 0
    second_output = None
    for k in range(1, n - 1):
        op = rng.choice(["conv", "relu", "bn", "add", "view"] if views else ["conv", "relu", "bn", "add"])
        if op == "add" and len(names) >= 2:
            ins = rng.sample(names, 2)
            ins.sort(key=names.index)
        else:
            # prefer recent nodes, sometimes reach back
            pick = names[-1] if rng.random() < 0.7 else rng.choice(names)
            ins = [pick]
            if op == "add":
                op = "conv"
        name = f"n{k}_{op}"
        has_param = op in ("conv", "bn")
        rb = has_param or any(needs_grad[i] for i in ins)
        out = rng.randint(5, 60) * 1000
        if op == "view":
            impls = [Impl("default", 1e-6, 1e-6)]
            src_bytes = b.nodes[names.index(ins[0])].output_bytes or 20000
            b.add(
                name,
                "view",
                ins,
                0,
                impls,
                alias_of=0,
                requires_backward=rb,
                grad_bytes=src_bytes if rb else 0,
            )
        elif op == "add":
            t = rng.uniform(5e-5, 3e-4)
            first_bytes = b.nodes[names.index(ins[0])].output_bytes
            if first_bytes and k % 2 == 0:
                out = first_bytes  # the sum may be written into its first argument
            b.add(
                name,
                "add",
                ins,
                out,
                [Impl("default", t, t / 2, grad_in_place=0, grad_shared=(1,), fwd_in_place=0)],
                requires_backward=rb,
                grad_bytes=out if rb else 0,
            )
        else:
            b.add(
                name,
                op,
                ins,
                out,
                impls_for(op),
                requires_backward=rb,
                grad_bytes=out if rb else 0,
                param_grad_bytes=rng.randint(1, 20) * 1000 if has_param else 0,
            )
        for i in ins:
            consumers[i] += 1
        names.append(name)
        needs_grad[name] = rb
        consumers[name] = 0
        if multi_output and second_output is None and k == n // 2 and rb and op != "view":
            second_output = name
    # the loss reads every node nobody consumes (so every gradient is defined)
    dangling = [nm for nm in names if consumers[nm] == 0]
    last_in = dangling if dangling else [names[-1]]
    loss_impl = Impl("default", 1e-5, 1e-5, keeps_inputs=tuple(range(len(last_in))), state_bytes=8)
    b.add("loss", "loss", last_in, 4, [loss_impl], is_output=True, requires_backward=True, grad_bytes=4)
    if second_output is not None:
        idx = names.index(second_output)
        b.nodes[idx] = Node(**{**b.nodes[idx].__dict__, "is_output": True})
    # a node that needs no grad but whose consumer needs it: fine; a node that needs
    # a backward must reach the loss (true: every node does)
    return b.problem(fixed_bytes=rng.randint(0, 5) * 1000)


def with_step_in_backward(problem: Problem, ratio: float = 2.0) -> Problem:
    """`problem` with each node's parameter gradients freed after its backward, after an optimizer
    step whose temporaries are `ratio` times their size (the optimizer step in the backward)."""
    nodes = tuple(
        dataclasses.replace(
            n, param_grad_freed_bytes=n.param_grad_bytes, param_step_bytes=int(ratio * n.param_grad_bytes)
        )
        for n in problem.nodes
    )
    return dataclasses.replace(problem, nodes=nodes, fingerprint=problem.fingerprint + ":step")


def with_deferred_param_grads(problem: Problem) -> Problem:
    """`problem` with the weight gradients deferred (`Node.deferred_param_grad_bytes`) of every
    convolution or linear node whose parameter gradient is bigger than what computing it after
    the last backward stage needs held: its input's storage (a view's base) and its output's
    gradient, which become its `param_grad_bytes`."""
    by = {n.name: n for n in problem.nodes}
    nodes = []
    for n in problem.nodes:
        if n.op in ("conv2d", "linear") and n.requires_backward and n.inputs and not n.param_grad_freed_bytes:
            held = storage_bytes(by, n.inputs[0]) + n.grad_bytes
            if n.param_grad_bytes > held:
                n = dataclasses.replace(
                    n, deferred_param_grad_bytes=n.param_grad_bytes, param_grad_bytes=held
                )
        nodes.append(n)
    return dataclasses.replace(problem, nodes=tuple(nodes), fingerprint=problem.fingerprint + ":deferred")


def with_restores(
    problem: Problem, packed: float = 0.4, slower: float = 1.1, unpack: float = 0.05
) -> Problem:
    """`problem` where every convolution reading a ReLU output (an owned storage) may keep that
    input packed: a "packed" implementation whose state holds `packed` times the input's bytes
    instead of the input (backward `slower` times as long), and the ReLU output may be restored
    from that state in `unpack` times the ReLU's forward time (`Restore`), as
    `monet_opt`'s zero-packed convolution inputs allow."""
    by_name = {n.name: n for n in problem.nodes}
    restores: dict[str, list[Restore]] = {}
    nodes = []
    for n in problem.nodes:
        src = by_name.get(n.inputs[0]) if n.inputs else None
        conv = n.impls[0]
        if (
            n.op == "conv2d"
            and src is not None
            and src.op == "relu"
            and src.alias_of is None
            and conv.keeps_inputs == (0,)
        ):
            extra = dataclasses.replace(
                conv,
                name="packed",
                bwd_time=conv.bwd_time * slower,
                keeps_inputs=(),
                state_bytes=conv.state_bytes + int(packed * src.output_bytes),
            )
            n = dataclasses.replace(n, impls=(*n.impls, extra))
            restores.setdefault(src.name, []).append(
                Restore(f"restore_from:{n.name}", n.name, "packed", unpack * src.impls[0].fwd_time)
            )
        nodes.append(n)
    nodes = [dataclasses.replace(n, restores=tuple(restores.get(n.name, ()))) for n in nodes]
    return dataclasses.replace(problem, nodes=tuple(nodes), fingerprint=problem.fingerprint + ":restores")


def with_state_from_inputs(problem: Problem, op: str = "conv2d") -> Problem:
    """The problem with every implementation of an `op` node that keeps only inputs (no output,
    no private bytes, not in place) marked `bwd_from_inputs`: its state can be made from its inputs
    without its forward, as the runtime does for a convolution (a schedule's `make_state` step)."""
    nodes = []
    for n in problem.nodes:
        if n.op == op:
            impls = tuple(
                dataclasses.replace(im, bwd_from_inputs=True) if im.keeps_inputs_only else im
                for im in n.impls
            )
            n = dataclasses.replace(n, impls=impls)
        nodes.append(n)
    return dataclasses.replace(problem, nodes=tuple(nodes), fingerprint=problem.fingerprint + ":from_inputs")


def with_nograd_workspace(problem: Problem) -> Problem:
    """`problem` with workspaces of computations without grad (`Impl.nograd_fwd_workspace`) as
    autocast makes them: an implementation with private state makes it without grad too, and
    frees it (its workspace grows by its state); one without keeps half its workspace."""
    nodes = tuple(
        dataclasses.replace(
            n,
            impls=tuple(
                dataclasses.replace(
                    im,
                    nograd_fwd_workspace=im.fwd_workspace + im.state_bytes
                    if im.state_bytes
                    else im.fwd_workspace // 2,
                )
                for im in n.impls
            ),
        )
        for n in problem.nodes
    )
    return dataclasses.replace(problem, nodes=nodes, fingerprint=problem.fingerprint + ":nograd")


def problem_zoo() -> dict[str, Problem]:
    """The small zoo the strategy tests sweep over."""
    return {
        "chain8": chain(8, seed=1),
        "chain12": chain(12, seed=2),
        "chain12_from_inputs": with_state_from_inputs(chain(12, seed=2)),
        "resnet50": resnet(50, seed=3),
        "resnet_bneck60": resnet(60, seed=4, bottleneck=True),
        "random10": random_dag(10, seed=5),
        "random16": random_dag(16, seed=6),
        "random16_nograd": with_nograd_workspace(random_dag(16, seed=6)),
        "random24": random_dag(24, seed=7),
        "transformer2": transformer(2, seed=8),
    }
