"""EAGLE-3 heads and the target's aux hidden states on CUDA (Triton kernels, CUDA graphs).

    python -m pytest -m gpu tests/gpu/test_gpu_eagle3.py

- fp32: a head of hidden 256 (heads of 64, 300 draft tokens of 1000) prefills 70 tokens (extend
  attention) and drafts 4 chained steps (decode attention); every step's logits and hidden states
  are within REL_TOL of max |value| of the CPU reference's (tests/helpers/eagle3.py) on the same
  tokens and features (Triton's fp32 dots may round through TF32).
- Four chained steps replayed from one CUDA graph draft exactly the eager steps' tokens.
- The target's aux hidden states (a 7-layer Llama of helpers.models' GPU sizes) from a prefill and
  from a decode step replayed from a CUDA graph are the eager step's, and within REL_TOL (bf16:
  BF16_REL_TOL) of transformers' output_hidden_states (fp32, CPU).
- Served (`eagle3`, a 4-layer target): greedy output with drafts at every step is transformers',
  with CUDA graphs and without; the features the target's captured graphs store are fc of an
  eager forward's aux states; the head's chained steps from its own graphs draft the eager ones.
"""

import pytest
import torch
from helpers.eagle3 import head_tensors, reference_head, write_head
from helpers.models import make_gpu_model

from benchmark.engine.static_benchmark import capture
from benchmark.lib.one_request import decode_batch, extend_batch, slot_table
from lightllm.common.token_table import TokenTable
from lightllm.models import Eagle3Config, load_eagle3, load_model, read_config, read_eagle3_config
from lightllm.utils.dist import TPGroup

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = torch.device("cuda")
MAX_LEN = 128
REL_TOL = 1e-2
BF16_REL_TOL = 5e-2
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=1000, draft_vocab_size=300, target_hidden_size=256)


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float().cpu() - reference).abs().max() / reference.abs().max())


def gpu_head(tmp_path, seed):
    tensors = head_tensors(seed=seed, **SIZES)
    write_head(tmp_path, tensors, **SIZES)
    head = load_eagle3(read_eagle3_config(tmp_path), dtype=torch.float32, device=GPU, tp=TPGroup(),
                       max_positions=MAX_LEN)
    return tensors, head, TokenTable(MAX_LEN, 1, head.kv_heads, SIZES["head_dim"], torch.float32, GPU)


def prefill(head, kv, n, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(SIZES["vocab_size"], (n,), generator=gen)
    features = torch.randn(n, 3 * SIZES["target_hidden_size"], generator=gen)
    batch = extend_batch(tokens.to(GPU), 0, slot_table(MAX_LEN, GPU), SIZES["head_dim"])
    logits, hidden = head.forward(batch, kv, features.to(GPU))
    return tokens.tolist(), list(features), logits, hidden


@torch.inference_mode()
def test_head_on_cuda_matches_the_reference(tmp_path):
    tensors, head, kv = gpu_head(tmp_path, seed=7)
    tokens, features, logits, hidden = prefill(head, kv, 70, seed=8)
    ref_logits, ref_hidden = reference_head(tensors, tokens, features, **SIZES)
    assert rel_err(logits, ref_logits) < REL_TOL and rel_err(hidden, ref_hidden) < REL_TOL
    req_to_token = slot_table(MAX_LEN, GPU)
    for _ in range(4):  # the reference takes our drafts and hidden states: a near-tie cannot cascade
        draft = head.target_ids(logits[-1].argmax())
        tokens.append(int(draft))
        features.append(hidden[-1].cpu())
        position = torch.tensor([len(tokens) - 1], device=GPU)
        logits, hidden = head.forward(decode_batch(draft[None], position, req_to_token, MAX_LEN), kv, hidden[-1:])
        ref_logits, ref_hidden = reference_head(tensors, tokens, features, **SIZES)
        assert rel_err(logits[0], ref_logits[-1]) < REL_TOL and rel_err(hidden[0], ref_hidden[-1]) < REL_TOL


@torch.inference_mode()
def test_chained_head_steps_replay_from_a_cuda_graph(tmp_path):
    _, head, kv = gpu_head(tmp_path, seed=9)
    tokens, _, logits, hidden = prefill(head, kv, 20, seed=10)
    req_to_token = slot_table(MAX_LEN, GPU)
    first, position, features = head.target_ids(logits[-1:].argmax(-1)), torch.tensor([20], device=GPU), hidden[-1:]

    def chain():
        token, feature, drafts = first, features, []
        for j in range(4):
            step_logits, feature = head.forward(decode_batch(token, position + j, req_to_token, MAX_LEN), kv, feature)
            token = head.target_ids(step_logits.argmax(-1))
            drafts.append(token)
        return torch.cat(drafts)

    eager = chain().clone()
    graph, replayed = capture(chain)
    replayed.zero_()
    graph.replay()
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_aux_hidden_states_from_a_cuda_graph(tmp_path, dtype):
    """bf16: the stream as the down projection's split partial sums are added in the next norm."""
    tol = REL_TOL if dtype == torch.float32 else BF16_REL_TOL
    hf_model = make_gpu_model("llama_gqa_llama3_rope", tmp_path, num_hidden_layers=7)
    layers = Eagle3Config(None, 0, 256).aux_layers(7)
    model = load_model(read_config(tmp_path), dtype=dtype, device=GPU, tp=TPGroup(), max_positions=MAX_LEN)
    cfg = model.config
    kv = TokenTable(MAX_LEN, cfg.num_layers, model.kv_heads, cfg.head_dim, dtype, GPU, model.kv_shapes)
    ids = torch.randint(cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(11))
    hidden = hf_model(ids[None], output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i][0] for i in layers], -1)
    req_to_token = slot_table(MAX_LEN, GPU)
    _, aux = model.forward(extend_batch(ids[:40].to(GPU), 0, req_to_token, cfg.head_dim, layers), kv)
    assert rel_err(aux, expected[:40]) < tol
    token, position = ids[40:].to(GPU), torch.tensor([40], device=GPU)

    def step():
        return model.forward(decode_batch(token, position, req_to_token, MAX_LEN, layers), kv)[1]

    eager = step().clone()
    graph, replayed = capture(step)
    replayed.zero_()
    graph.replay()
    torch.testing.assert_close(replayed, eager)
    assert rel_err(eager[0], expected[40]) < tol


def serving_setup(tmp_path, cuda_graph):
    """A 4-layer target of GPU_SIZES and a head served beside it (eagle3, k = 4), fp32."""
    import json

    from helpers.models import make_runner

    hf_model = make_gpu_model("llama_gqa_llama3_rope", tmp_path / "target", num_hidden_layers=4)
    write_head(tmp_path / "head", head_tensors(seed=12, **SIZES), eagle_aux_hidden_state_layer_ids=[0, 1, 2], **SIZES)
    config = json.dumps({"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 4})
    runner = make_runner(tmp_path / "target", tokens=8192, device="cuda", cuda_graph=cuda_graph, max_req_total_len=512,
                         running_max_req_size=64, speculative_config=config)
    return hf_model, runner, config


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_a_served_head_gives_transformers_greedy_tokens(tmp_path, cuda_graph):
    """Drafts from the head at every step (features stored by the target's captured decode and
    mixed-step graphs, or eagerly), verified: the target's greedy tokens."""
    from helpers.models import GPU_SIZES, Client, assert_idle, engine, hf_greedy, random_prompts

    from lightllm.engine.request import SamplingParams
    from lightllm.engine.spec.config import SpeculativeConfig
    from lightllm.engine.spec.controller import Speculator

    hf_model, runner, config = serving_setup(tmp_path, cuda_graph)
    prompts = random_prompts(4, [5, 130, 37, 300, 17, 64], vocab=GPU_SIZES["vocab_size"])
    expected = hf_greedy(hf_model.to("cuda"), prompts, 40)
    core = engine(runner, 128)
    spec = Speculator(SpeculativeConfig.parse(config), GPU_SIZES["vocab_size"], 64 * 5, drafter=runner.draft)
    spec.guard = None
    spec.allocate = lambda alphas, limits, tokens, outputs: [min(n, spec.k_max) for n in limits] if sum(limits) else None  # drafts every step: this checks the tokens
    core.scheduler.speculator = spec
    got = Client(core).run(prompts, SamplingParams(max_new_tokens=40), staggered=True)
    assert got == [expected[i] for i in range(len(prompts))]
    assert spec.num_draft_tokens > 0
    assert_idle(core)


@torch.inference_mode()
def test_features_stored_from_cuda_graphs_are_the_eager_forwards(tmp_path):
    """A prefill (a mixed-step graph), decodes and a verify step (decode graphs): the features at
    the request's slots are fc of the aux hidden states of one eager forward over its tokens."""
    from lightllm.engine.plan import Chunk, StepPlan
    from lightllm.engine.request import SamplingParams

    _, runner, _ = serving_setup(tmp_path, cuda_graph=True)
    assert runner.graphs.graphs and runner.graphs.mixed_graphs  # captured
    prompt = torch.randint(1000, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    (result,) = runner.step(StepPlan(1, [], [Chunk(0, prompt, 0, True, SamplingParams())], sync=True))
    tokens = prompt + [result.tokens[0].token_id]
    for step in range(2, 5):
        (result,) = runner.step(StepPlan(step, [0], sync=True))
        tokens += [result.tokens[0].token_id]
    (result,) = runner.step(StepPlan(5, [0], drafts={0: [3, 4, 5]}, sync=True))
    tokens += [t.token_id for t in result.tokens]
    r = runner.reqs[0]
    slots = runner.req_table.req_to_token[r.row, : r.seq_len].long()
    model, head = runner.model, runner.drafter.head
    cfg = model.config
    kv = TokenTable(MAX_LEN, cfg.num_layers, model.kv_heads, cfg.head_dim, torch.float32, GPU, model.kv_shapes)
    batch = extend_batch(torch.tensor(tokens[: r.seq_len], device=GPU), 0, slot_table(MAX_LEN, GPU), cfg.head_dim,
                         runner.drafter.aux_layers)
    expected = head.feature(model.forward(batch, kv)[1])
    assert rel_err(runner.drafter.features[slots], expected.cpu()) < REL_TOL
    runner.free([0])


def test_chained_steps_from_head_graphs_propose_the_eager_drafts(tmp_path):
    """Three requests in one proposal call (decode bucket 4: a padding row): the drafts of a runner
    whose head replays its captured chained-step graphs are the eager runner's."""
    from helpers.models import make_runner, random_prompts

    from lightllm.engine.plan import Chunk, DraftRequest, StepPlan
    from lightllm.engine.request import SamplingParams

    _, graphed, config = serving_setup(tmp_path, cuda_graph=True)
    assert graphed.drafter.graphs.graphs  # captured
    eager = make_runner(tmp_path / "target", tokens=8192, device="cuda", cuda_graph=False, max_req_total_len=512,
                        running_max_req_size=64, speculative_config=config)
    prompts = random_prompts(6, [30, 7, 55], vocab=1000)
    got = []
    for runner in (graphed, eager):
        asks = []
        for i, prompt in enumerate(prompts):
            (result,) = runner.step(StepPlan(i + 1, [], [Chunk(i, prompt, 0, True, SamplingParams())], sync=True))
            asks.append(DraftRequest(i, 0, tuple(prompt + [result.tokens[0].token_id]), 4))
        got.append(runner.draft(asks))
        runner.free([0, 1, 2])
    assert got[0] == got[1] and all(len(drafts) == 4 for drafts, _ in got[0])
