"""Multi-LoRA on Ray ranks at TP=2 (over gloo): each rank holds its shard of every adapter
slot (the q/k/v and gate/up B rows, the o/down A columns of its heads and width) and the
partial deltas of the row-parallel projections add up in their reduction; a batch mixing
adapters (more than the slots) and the base gets PEFT's greedy tokens."""

from __future__ import annotations

from lora_adapters import ATTENTION, MLP, peft_greedy, write_adapter
from oracle import random_prompts

from nvray import LLM, LoRARequest, SamplingParams


def test_tp2_shards_the_adapters_and_gives_pefts_tokens(ray_cluster, tiny_path, tmp_path):
    paths = {"all": write_adapter(tiny_path, str(tmp_path / "all"), 8, ATTENTION + MLP, seed=31),
             "ov": write_adapter(tiny_path, str(tmp_path / "ov"), 4, ["o_proj", "v_proj"],
                                 seed=32, std=0.3),
             "mlp": write_adapter(tiny_path, str(tmp_path / "mlp"), 16, MLP, seed=33)}
    names = ["all", None, "ov", "mlp", "all"]
    prompts = random_prompts(len(names), 10, 40, seed=37)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM("tiny", tensor_parallel_size=2, max_model_len=256, enable_lora=True, max_loras=2)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[LoRARequest(n, 1, paths[n]) if n else None
                                          for n in names])
        loads = llm.stats()["lora"]["num_loads"]
    finally:
        llm.shutdown()
    for name, prompt, out in zip(names, prompts, outs):
        assert list(out.token_ids) == peft_greedy(tiny_path, paths.get(name), prompt, 10), name
    assert loads >= 3
