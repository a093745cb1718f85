"""``nvray/bench/engine_here.py``: a bench's engine in this process over two rank actors (gloo),
whose ranks' models ``on_ranks`` reaches: the speculative bench's echo weights, applied to
every rank's shards, make the tensor-parallel model repeat its last token (applied to one
rank's alone, the other rank's partial sums would still move the residual stream)."""

from __future__ import annotations

from nvray import SamplingParams
from nvray.bench.engine_here import engine_here, on_ranks
from nvray.bench.speculative import echo_weights
from nvray.worker.rank_facts import rank_facts


def test_echo_weights_reach_every_rank_of_a_tensor_parallel_engine(ray_cluster) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = engine_here("tiny", tensor_parallel_size=2, max_model_len=128)
    try:
        assert llm.engine.limits.parallelism["tensor_parallel_size"] == 2
        seen = on_ranks(llm, rank_facts)  # (it must pickle)
        assert [facts.parallelism["tensor_parallel_size"] for facts in seen] == [2, 2]
        prompts = [[11, 12, 13, 14, 15, 16, 17, 18 + i] for i in range(3)]
        random_net = llm.generate(prompts, greedy, use_tqdm=False)
        assert any(list(o.token_ids) != [p[-1]] * 8 for o, p in zip(random_net, prompts))
        echo_weights(llm)
        echoed = llm.generate([[p[0] + 100] + p for p in prompts], greedy, use_tqdm=False)
        assert [list(o.token_ids) for o in echoed] == [[p[-1]] * 8 for p in prompts]
    finally:
        llm.shutdown()
