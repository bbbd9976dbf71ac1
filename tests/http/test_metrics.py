"""The scheduler's Prometheus endpoint, scraped over real HTTP and parsed with prometheus_client."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minirt.client import open_client
from tests.support.runtime import start_runtime, wait_until


async def test_metrics_endpoint_counts_requests_and_latencies(tiny_model, tmp_path):
    with start_runtime(tiny_model, tmp_path / "rt", "--metrics-port", "0") as rt:
        [listening] = rt.events("metrics.listening")
        async with open_client(rt.endpoint) as client:
            for i in range(3):
                await client.generate(prompt_ids=[3 + i, 4, 5, 6], max_tokens=5)

        def scrape() -> dict:
            with urllib.request.urlopen(listening["url"], timeout=5) as resp:
                assert resp.status == 200
                text = resp.read().decode()
            return {
                s.name: s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if not s.labels or s.labels.get("finished_reason") == "length"
            }

        samples = await wait_until(
            lambda: (m := scrape()).get("minirt:request_success_total", 0) >= 3 and m, timeout=10
        )
        assert samples["minirt:time_to_first_token_seconds_count"] == 3
        assert samples["minirt:e2e_request_latency_seconds_count"] == 3
        assert samples["minirt:generation_tokens_total"] == 15
        assert samples["minirt:num_requests_running"] == 0
        assert 0.0 <= samples["minirt:kv_cache_usage_perc"] <= 1.0
        assert "minirt:num_preemptions_total" in samples
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(listening["url"].replace("/metrics", "/nope"), timeout=5)
        assert info.value.code == 404
