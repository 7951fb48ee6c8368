"""Batch inference on Ray Data: OpenAI batch files (or datasets of their lines) through
engine replicas in an autoscaling actor pool, resumable, one result per line.

    processor.py   BatchConfig, build_processor: preprocess (CPU actors) -> engine actors
                   -> postprocess (CPU actors) over a ray.data.Dataset
    stages.py      the three stages' callable classes
    job.py         run_batch_file: INPUT.jsonl -> OUTPUT.jsonl, parts committed by rename
    format.py      the OpenAI batch line, in and out
    routes.py      BatchRoutes: what the job needs of the API's routes (handed in by the
                   caller; deployments/serving/batch_routes.py has the server's)

Imports only engine/ and below, never deployments/ (DESIGN.md section 3).
"""

from rayserve_paged.batch.processor import LAPTOP_ENGINE, BatchConfig, build_processor

__all__ = ["LAPTOP_ENGINE", "BatchConfig", "build_processor"]
