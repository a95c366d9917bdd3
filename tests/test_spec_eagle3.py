"""Speculative decoding with an EAGLE-3 head (a tiny random head over a 4-layer random Llama, fp32):
the runner's proposals are the head's greedy chain as the plain-torch reference computes it
(helpers/eagle3.py) from the features of one plain target forward over the whole sequence, after
a chunked prefill, a catch-up split over two calls, a verify step that rejected drafts, a
prefix-cache hit and a prefix loaded back from the host tier, and over a Qwen3 target; the
offline LLM's output with the head drafting at every step is its output without speculation, and
at tp 2 its proposals are tp 1's; a server loads the head and answers the same greedy text; the
head's KV and features are counted in the KV budget; targets a head cannot serve are refused."""

import json
import shutil

import pytest
import torch
from helpers.eagle3 import head_tensors, reference_head, reference_target_id, write_head
from helpers.models import hf_greedy, make_model, make_runner, random_prompts

from benchmark.lib.one_request import extend_batch, slot_table
from lightllm.common.radix_cache import Evict, Insert, Load, Offload
from lightllm.common.token_table import TokenTable
from lightllm.engine.plan import Chunk, DraftRequest, Release, StepPlan
from lightllm.engine.request import SamplingParams
from lightllm.engine.spec.config import SpeculativeConfig
from lightllm.models import load_model, read_config
from lightllm.utils.dist import TPGroup

CPU = torch.device("cpu")
LAYERS = 4
AUX_IDS = [0, 1, 2]  # the head's config names the outputs of layers 0-2: the inputs of layers 1-3
AUX = (1, 2, 3)
HEAD_SIZES = dict(target_hidden_size=64)  # the target's hidden size (helpers.models.BASE)
MAX_LEN = 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target dir, its transformers model, head dir, the head's tensors for the reference, our target
    model for reference features). The head has no embedding of its own: it shares the target's."""
    target, head = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("head")
    hf_target = make_model("llama_gqa_llama3_rope", target, num_hidden_layers=LAYERS)
    tensors = head_tensors(seed=3, **HEAD_SIZES)
    del tensors["embed_tokens.weight"]
    write_head(head, tensors, eagle_aux_hidden_state_layer_ids=AUX_IDS, **HEAD_SIZES)
    tensors["embed_tokens.weight"] = hf_target.model.embed_tokens.weight.detach().clone()
    plain = load_model(read_config(target), dtype=torch.float32, device=CPU, tp=TPGroup(), max_positions=MAX_LEN)
    return target, hf_target, head, tensors, plain


def eagle3_config(head, k):
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})


def eagle3_runner(target, head, k=4, **settings):
    return make_runner(target, tokens=512, max_req_total_len=MAX_LEN, speculative_config=eagle3_config(head, k),
                       **settings)


@torch.inference_mode()
def target_aux(model, tokens):
    """The target's aux hidden states of every token, from one eager forward over them all."""
    cfg = model.config
    kv = TokenTable(MAX_LEN, cfg.num_layers, model.kv_heads, cfg.head_dim, torch.float32, CPU, model.kv_shapes)
    _, aux = model.forward(extend_batch(torch.tensor(tokens), 0, slot_table(MAX_LEN, CPU), cfg.head_dim, AUX), kv)
    return aux


def reference_chain(tensors, plain, tokens, k):
    """The head's greedy chain of k drafts after `tokens` (the last one sampled, not yet in the
    target's cache): row p pairs the target's features at p with the token at p + 1; chained rows
    take the head's own hidden state of the row before."""
    ids, features = list(tokens[1:]), list(target_aux(plain, tokens[:-1]))
    drafts = []
    for _ in range(k):
        logits, hidden = reference_head(tensors, ids, features, **HEAD_SIZES)
        drafts.append(reference_target_id(tensors, int(logits[-1].argmax())))
        ids.append(drafts[-1])
        features.append(hidden[-1])
    return drafts


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["padded", "eager"])
def test_proposals_are_the_reference_heads_chain(models, cuda_graph):
    """Features from a prefill in two chunks, from a verify step's rows (two drafts accepted, two
    rejected) and from another request's KV through the prefix cache: each proposal is the
    reference's chain over the whole sequence (steps as padded graphs' eager forwards, or eager)."""
    target, hf_target, head, tensors, plain = models
    runner = eagle3_runner(target, head, k=4, cuda_graph=cuda_graph)
    prompt = random_prompts(3, lengths=(23,))[0]
    runner.step(StepPlan(1, [], [Chunk(0, prompt[:9], 0, False, SamplingParams())], sync=True))
    (result,) = runner.step(StepPlan(2, [], [Chunk(0, prompt[9:], 9, True)], sync=True))
    tokens = prompt + [result.tokens[0].token_id]
    (_, drafted), = runner.draft([DraftRequest(0, 0, tuple(tokens[:10]), 0)])
    assert drafted == 9  # rows 0..8: each reads the token after its own
    (drafts, drafted), = runner.draft([DraftRequest(0, 9, tuple(tokens[9:]), 4)])
    assert drafted == len(tokens) - 1
    assert list(drafts) == reference_chain(tensors, plain, tokens, 4)
    truth = hf_greedy(hf_target, [tokens], 3)[0]
    fed = truth[:2] + [(truth[2] + 1) % 101, 7]
    (result,) = runner.step(StepPlan(3, [0], drafts={0: fed}, sync=True))
    tokens += [t.token_id for t in result.tokens]
    assert tokens[-3:] == truth
    (drafts, drafted), = runner.draft([DraftRequest(0, drafted, tuple(tokens[drafted:]), 3)])
    assert drafted == len(tokens) - 1
    assert list(drafts) == reference_chain(tensors, plain, tokens, 3)
    # a second request on the first 16 tokens' slots: their features are the first request's
    other = tokens[:16] + random_prompts(4, lengths=(5,))[0]
    chunk = Chunk(1, other[16:], 16, True, SamplingParams(), prefix=(1,))
    (result,) = runner.step(StepPlan(4, [], [chunk], ops=[Insert(0, 0, 16, 1)], sync=True))
    other.append(result.tokens[0].token_id)
    (drafts, _), = runner.draft([DraftRequest(1, 0, tuple(other), 4)])
    assert list(drafts) == reference_chain(tensors, plain, other, 4)
    runner.apply([Release(0, 16), Release(1, 16), Evict(1)])
    assert runner.token_table.used_count == 0


def test_a_prefix_back_from_the_host_tier_drafts_from_its_own_features(models):
    """A cached prefix offloaded to the host pool, its slots reused (every feature overwritten),
    then loaded into fresh slots for a second request: its proposals are the reference's chain, as
    the target computes no feature of the prefix again."""
    target, _, head, tensors, plain = models
    record = 2 * LAYERS * 2 * 16 * 4 + 64 * 4  # K and V of 2 heads of 16 a layer, and g of hidden 64, fp32
    runner = eagle3_runner(target, head, k=4, host_kv_cache_gb=64 * record / 2**30)
    assert runner.host_pool.capacity == 64
    prompt = random_prompts(5, lengths=(23,))[0]
    (result,) = runner.step(StepPlan(1, [], [Chunk(0, prompt, 0, True, SamplingParams())], sync=True))
    runner.apply([Insert(0, 0, 16, 1), Release(0, 16), Offload(1)])
    pool = runner.host_pool
    assert runner.token_table.used_count == 0 and pool.free_count == pool.capacity - 16
    runner.drafter.features.normal_()  # what other requests' steps would write to the freed slots
    runner.apply([Load(1)])
    other = prompt[:16] + random_prompts(6, lengths=(5,))[0]
    chunk = Chunk(1, other[16:], 16, True, SamplingParams(), prefix=(1,))
    (result,) = runner.step(StepPlan(2, [], [chunk], sync=True))
    other.append(result.tokens[0].token_id)
    (drafts, _), = runner.draft([DraftRequest(1, 0, tuple(other), 4)])
    assert list(drafts) == reference_chain(tensors, plain, other, 4)
    runner.apply([Release(1, 16), Evict(1)])
    assert runner.token_table.used_count == 0 and pool.free_count == pool.capacity


@pytest.fixture(scope="module")
def llm_target(models, default_model_dir, tmp_path_factory):
    """The target with the default model's tokenizer files (its ids below 101 decode), for the LLM."""
    target = tmp_path_factory.mktemp("llm_target")
    for path in models[0].iterdir():
        shutil.copy2(path, target / path.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(default_model_dir / name, target / name)
    return target


def llm_outputs(target, prompts, **settings):
    """Greedy tokens of every prompt through the offline LLM (chunked prefill of 8, prefix cache on),
    then the first prompt again (a prefix-cache hit); then (ids, text, finish, logprobs) of each
    choice of requests with seeded sampling and n = 2, logprobs, logit_bias with min_tokens, a
    presence penalty (no drafts) and a stop token; the speculator's counters and every proposal."""
    from lightllm.llm import LLM
    from lightllm.llm import SamplingParams as Params

    llm = LLM(target, max_total_token_num=1024, max_req_input_len=64, max_req_total_len=MAX_LEN, running_max_req_size=8,
              chunked_prefill_size=8, **settings)
    try:
        spec = llm.engine.scheduler.speculator
        if spec is not None:  # drafts for every decoding request at every step: this checks the tokens
            spec.guard = None
            spec.allocate = lambda alphas, limits, tokens, outputs: [min(n, spec.k_max) for n in limits] if sum(limits) else None
            propose, proposals = spec.propose, []
            spec.propose = lambda wants: proposals.append(propose(wants)) or proposals[-1]
        params = Params(max_tokens=16, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        greedy = [o.outputs[0].token_ids for o in outs]
        varied = [Params(max_tokens=12, temperature=0.8, seed=7, n=2, ignore_eos=True),
                  Params(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True),
                  Params(max_tokens=12, temperature=0, logit_bias={5: 3.0}, min_tokens=4, ignore_eos=True),
                  Params(max_tokens=12, temperature=0, presence_penalty=0.5, ignore_eos=True),
                  Params(max_tokens=12, temperature=0, stop_token_ids=[greedy[1][6]])]
        outs = llm.generate([{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(len(varied))], varied,
                            use_tqdm=False)
        choices = [(c.token_ids, c.text, c.finish_reason, c.logprobs) for o in outs for c in o.outputs]
        return greedy, choices, None if spec is None else (spec.stats(), proposals)
    finally:
        llm.shutdown()


LLM_PROMPTS = random_prompts(5, lengths=(3, 21, 12))


@pytest.fixture(scope="module")
def head_run(models, llm_target):
    head = models[2]
    return llm_outputs(llm_target, LLM_PROMPTS, speculative_config={"method": "eagle3", "model": str(head),
                                                                    "num_speculative_tokens": 3})


def test_llm_output_is_unchanged_by_the_head(models, llm_target, head_run):
    """Greedy tokens (transformers'), seeded samples, logprobs, logit_bias, penalties and stop
    tokens: the same with the head's drafts at every step as without speculation."""
    hf_target = models[1]
    plain, plain_choices, _ = llm_outputs(llm_target, LLM_PROMPTS)
    got, choices, (stats, _) = head_run
    expected = hf_greedy(hf_target, LLM_PROMPTS, 16)
    assert plain == [expected[0], expected[1], expected[2], expected[0]]
    assert got == plain
    assert stats["num_draft_tokens"] >= 3 * 5  # every request verified drafts, several times
    assert plain_choices[-1][2] == "stop" and len(plain_choices) == 6
    for (ids, text, finish, logprobs), (ids0, text0, finish0, logprobs0) in zip(choices, plain_choices):
        assert (ids, text, finish) == (ids0, text0, finish0)
        for pos, pos0 in zip(logprobs or (), logprobs0 or ()):  # the target's logprobs
            assert pos.keys() == pos0.keys() and all(abs(pos[t].logprob - pos0[t].logprob) < 1e-4 for t in pos)
    assert choices[2][3] is not None


def test_two_ranks_propose_what_one_does(models, llm_target, head_run):
    """tp 2 (worker processes, gloo): each rank's fc takes half the aux features and all-reduces
    g; the head's heads, MLP and draft vocabulary are split. The same drafts, the same output."""
    got, choices, (_, proposals) = llm_outputs(llm_target, LLM_PROMPTS, tp=2, speculative_config={
        "method": "eagle3", "model": str(models[2]), "num_speculative_tokens": 3})
    assert (got, [c[:3] for c in choices]) == (head_run[0], [c[:3] for c in head_run[1]])
    assert proposals == head_run[2][1] and sum(len(d) for p in proposals for d in p.values()) >= 3 * 5


def test_the_heads_kv_and_features_are_in_the_budget(models):
    """Each target slot has a row of the head's KV and a feature; each request row k_max scratch
    rows of head KV; the padding rows' slot one of each."""
    target, _, head = models[:3]
    runner = eagle3_runner(target, head, k=3)
    plain = make_runner(target, tokens=512, max_req_total_len=MAX_LEN)
    per_token, fixed = runner.kv_bytes()
    head_kv, feature = 2 * 2 * 16 * 4, 64 * 4  # K and V of 2 heads of 16, and g of hidden 64, fp32
    assert per_token == plain.kv_bytes()[0] + head_kv + feature
    rows = runner.req_table.max_reqs + 1
    assert fixed == (1 + rows * 3) * head_kv + feature
    assert runner.drafter.kv.size == 512 + 1 + rows * 3 and runner.drafter.kv.scratch_slot == 512
    assert runner.drafter.features.shape == (512 + 1, 64)
    echo = eagle3_runner(target, head, k=3, load_format="dummy_echo")  # the benchmarks' target and an echo head
    assert echo.kv_bytes() == (per_token, fixed)


def test_eagle3_config_needs_a_head_and_info_shows_it():
    with pytest.raises(ValueError, match="needs \"model\": the EAGLE-3 head"):
        SpeculativeConfig.parse({"method": "eagle3"})
    config = {"method": "eagle3", "model": "/heads/x", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(json.dumps(config)).describe() == config


def test_targets_a_head_cannot_serve_are_refused(models, tmp_path):
    """Not of the Llama family (Gemma 4), a recurrent state (Qwen3-Next), another hidden size."""
    from test_hybrid_models import make_hybrid

    head = models[2]
    make_model("gemma4_plain", tmp_path / "gemma4")
    with pytest.raises(ValueError, match="Llama family"):
        eagle3_runner(tmp_path / "gemma4", head)
    make_hybrid("qwen3_next", tmp_path / "hybrid")
    with pytest.raises(ValueError, match="recurrent state"):
        eagle3_runner(tmp_path / "hybrid", head)
    make_model("llama_gqa_llama3_rope", tmp_path / "wide", num_hidden_layers=LAYERS, hidden_size=128)
    with pytest.raises(ValueError, match="hidden states of size 64"):
        eagle3_runner(tmp_path / "wide", head)


def test_a_qwen3_target_gets_the_reference_heads_chain(models, tmp_path):
    """The Qwen family (q/k norms, head dim 24 here) through the same aux capture: proposals after
    a prefill and after verifying the head's own drafts are the reference's chain."""
    head, tensors = models[2], dict(models[3])
    hf_target = make_model("qwen3_head_dim_24", tmp_path, num_hidden_layers=LAYERS)
    tensors["embed_tokens.weight"] = hf_target.model.embed_tokens.weight.detach().clone()
    plain = load_model(read_config(tmp_path), dtype=torch.float32, device=CPU, tp=TPGroup(), max_positions=MAX_LEN)
    runner = eagle3_runner(tmp_path, head, k=4)
    prompt = random_prompts(7, lengths=(14,))[0]
    (result,) = runner.step(StepPlan(1, [], [Chunk(0, prompt, 0, True, SamplingParams())], sync=True))
    tokens = prompt + [result.tokens[0].token_id]
    (drafts, drafted), = runner.draft([DraftRequest(0, 0, tuple(tokens), 4)])
    assert list(drafts) == reference_chain(tensors, plain, tokens, 4)
    (result,) = runner.step(StepPlan(2, [0], drafts={0: list(drafts)}, sync=True))
    tokens += [t.token_id for t in result.tokens]
    (drafts, _), = runner.draft([DraftRequest(0, drafted, tuple(tokens[drafted:]), 4)])
    assert list(drafts) == reference_chain(tensors, plain, tokens, 4)
    runner.free([0])


def test_server_serves_the_head(models, llm_target, tmp_path):
    """A server with the eagle3 method: its worker process loads the head, /info shows the config,
    and a completion of token ids is the greedy text without speculation."""
    import requests
    from server_utils import start_server
    from transformers import AutoTokenizer

    config = {"method": "eagle3", "model": str(models[2]), "num_speculative_tokens": 3}
    server = start_server(["--model_dir", str(llm_target), "--max_total_token_num", "1024", "--max_req_input_len", "64",
                           "--max_req_total_len", str(MAX_LEN), "--running_max_req_size", "8",
                           "--speculative_config", json.dumps(config)], tmp_path / "server.log")
    try:
        assert requests.get(f"{server.url}/info", timeout=10).json()["speculative_config"] == config
        body = {"prompt": LLM_PROMPTS[1], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        response = server.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        expected = hf_greedy(models[1], [LLM_PROMPTS[1]], 48)[0]
        assert response.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(llm_target).decode(
            expected, skip_special_tokens=True)
    finally:
        assert server.stop() == 0


def test_an_echo_head_beside_an_echo_target_drafts_what_the_target_samples(models, tmp_path):
    """load_format dummy_echo (benchmarks): the target answers each token with itself and the head,
    over the target's whole vocabulary, drafts the token its feature came from, so after the first
    sampled token every draft is accepted: the head's fc passes the first feature through."""
    target = models[0]
    head = tmp_path / "echo_head"
    write_head(head, {}, eagle_aux_hidden_state_layer_ids=AUX_IDS, draft_vocab_size=101, **HEAD_SIZES)
    runner = eagle3_runner(target, head, k=4, load_format="dummy_echo")
    prompt = random_prompts(9, lengths=(11,))[0]
    (result,) = runner.step(StepPlan(1, [], [Chunk(0, prompt, 0, True, SamplingParams())], sync=True))
    tokens = prompt + [result.tokens[0].token_id]
    assert tokens[-1] == prompt[-1]  # the echo target
    (drafts, drafted), = runner.draft([DraftRequest(0, 0, tuple(tokens), 4)])
    assert list(drafts) == [prompt[-1]] * 4
    (result,) = runner.step(StepPlan(2, [0], drafts={0: list(drafts)}, sync=True))
    assert [t.token_id for t in result.tokens] == [prompt[-1]] * 5  # every draft kept, and the token after
    tokens += [t.token_id for t in result.tokens]
    (drafts, _), = runner.draft([DraftRequest(0, drafted, tuple(tokens[drafted:]), 4)])
    assert list(drafts) == [prompt[-1]] * 4
    runner.free([0])
