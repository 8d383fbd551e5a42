"""Generate a Parquet dataset's completions on a Ray cluster: one specbatch engine per GPU actor.

    pip install -e '.[ray]'
    python examples/ray_job.py s3://bucket/prompts/ s3://bucket/completions/ /models/m /models/eagle3-head

Rows: `prompt` (or `messages`, or `tokenized_prompt`), an `id`, and optionally `sampling_params`.
Rerunning after a failure skips the rows already written (Ray Data checkpointing on `id`).
"""
import sys

import ray
from ray.data.checkpoint import CheckpointConfig

from specbatch.ray import ProcessorConfig, build_processor

src, dst, model, draft = sys.argv[1:5]
ray.init()
ray.data.DataContext.get_current().checkpoint_config = CheckpointConfig(id_column="id", checkpoint_path=dst + ".ckpt")
processor = build_processor(ProcessorConfig(model_source=model, recipe="eagle3_topk1", draft=draft,
                                            concurrency=int(ray.cluster_resources().get("GPU", 1)),
                                            # rows in flight per actor ~ 2 x its engine's slots (logged)
                                            batch_size=64, max_concurrent_batches=16,
                                            should_continue_on_error=True))
processor(ray.data.read_parquet(src)).write_parquet(dst)
