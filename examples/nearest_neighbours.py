"""Embed a text file with a scoring job, then print the nearest neighbours of a query.

    python examples/nearest_neighbours.py [--text FILE] [--query TEXT] [-k 5] [--url grpc://host:port]

Each line of the file is a row. ``score()`` sends them through the ``minilm`` ensemble (tokenizer -> MiniLM encoder,
mean-pooled, normalised: all-MiniLM-L6-v2) in batches, in order, into a ``.npy`` file, resumably. The query is
embedded the same way, and since the embeddings are unit vectors, a dot product is the cosine similarity.
Without ``--url`` it starts an embedded server holding only the ensemble and its two models.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np

from triton_npu_client import Client, LocalTriton, Model, ScoreSummary, score

HERE = Path(__file__).resolve().parent
DEFAULT_TEXT = HERE / "data" / "persuasion_sentences.txt"  # 400 sentences of Jane Austen's Persuasion
DEFAULT_QUERY = "She regretted refusing his proposal of marriage years ago."


async def nearest(
    model: Model, text: Path, query: str, *, k: int = 5, workdir: Path, concurrency: int = 4
) -> tuple[ScoreSummary, list[tuple[float, str]]]:
    """Score ``text`` into ``workdir``/embeddings.npy and return the job's summary and the top ``k`` lines."""
    summary = await score(model, text, workdir / "embeddings.npy", concurrency=concurrency, progress=False)
    embeddings = np.load(workdir / "embeddings.npy", mmap_mode="r")
    lines = await asyncio.to_thread(lambda: text.read_text(encoding="utf-8").splitlines())
    if embeddings.shape[0] != len(lines):
        raise SystemExit(f"expected {len(lines)} embeddings, got {embeddings.shape[0]}")
    q = (await model.infer(TEXT=query))["EMBEDDING"][0]
    similarity = np.asarray(embeddings @ q)
    top = np.argsort(-similarity)[:k]
    return summary, [(float(similarity[i]), lines[i]) for i in top]


async def run_demo(client: Client, *, text: Path = DEFAULT_TEXT, query: str = DEFAULT_QUERY, k: int = 5) -> None:
    """The main job's scoring step: embed the sample text, print the summary and the neighbours of the query."""
    model = await client.model("minilm")
    with tempfile.TemporaryDirectory(prefix="triton-npu-example-") as folder:
        summary, top = await nearest(model, text, query, k=k, workdir=Path(folder))
    print(summary)
    print(f"nearest to {query!r}:")
    for similarity, line in top:
        print(f"  {similarity:.3f}  {line}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a text file, one row per line")
    parser.add_argument("--query", default=DEFAULT_QUERY)
    parser.add_argument("-k", type=int, default=5, help="how many neighbours (default 5)")
    parser.add_argument("--url", default=None, help="a running server; default: start one here")
    ns = parser.parse_args()
    if ns.url is not None:
        async with Client(ns.url) as client:
            await run_demo(client, text=ns.text, query=ns.query, k=ns.k)
        return
    async with (
        LocalTriton(model_control_mode="explicit", load_models=["minilm"]) as server,
        Client(server.grpc_url) as client,
    ):
        await run_demo(client, text=ns.text, query=ns.query, k=ns.k)


if __name__ == "__main__":
    asyncio.run(main())
