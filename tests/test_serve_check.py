"""Reading vLLM's speculative-decoding counters (the server itself runs in test_pipeline.py)."""

from eaglenest.serving.vllm import parse_spec_counters

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 92.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 276.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 61.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 6.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""


def test_spec_counters_are_read_by_name_and_position():
    c = parse_spec_counters(METRICS)
    assert c["spec_decode_num_drafts"] == 92 and c["spec_decode_num_draft_tokens"] == 276
    assert c["spec_decode_num_accepted_tokens"] == 61
    assert c["spec_decode_num_accepted_tokens_per_pos"] == [35, 20, 6]  # ordered by position
    assert "num_requests_running" not in c


def test_two_engines_add_up():
    two = METRICS + METRICS.replace('engine="0"', 'engine="1"')
    c = parse_spec_counters(two)
    assert c["spec_decode_num_drafts"] == 184 and c["spec_decode_num_accepted_tokens_per_pos"] == [70, 40, 12]
