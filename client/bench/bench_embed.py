"""`python -m client bench embed`: embeddings, our engine against transformers' batched forward
on the same texts, in the same run.

N random-token texts of L tokens each (bu.make_prompts). transformers: AutoModel (no head) in
batches of C texts (all the same length: no padding), last_hidden_state's last row normalized,
under torch.inference_mode. Ours, offline: LLM.embed of all N at once (the engine batches them
in its steps); with --server also served: C clients each sending its share of the texts as
embedding_request (vllm_backend's contract) over gRPC, one at a time, to a tritonserver started
here. Texts/s of each; the ratios ours / transformers (target >= 1.5). R rounds, the order
alternating; medians. The vectors are checked against transformers' (1e-4).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np
import torch

from backend import LLM
from client.bench import benchutil as bu

FULL = (64, 256, 16, 3)  # texts, tokens per text, concurrency, rounds
QUICK = (8, 32, 4, 1)


def hf_embed(model, texts: list[list[int]], batch: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            h = model(input_ids=torch.tensor(texts[i:i + batch])).last_hidden_state[:, -1]
            out.append(torch.nn.functional.normalize(h.float(), dim=-1))
    return time.perf_counter() - t0, torch.cat(out)


def ours_embed(llm: LLM, texts: list[list[int]]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    outs = llm.embed(texts)
    return time.perf_counter() - t0, torch.tensor([o.embedding for o in outs])


def served_embed(url: str, texts: list[list[int]], clients: int) -> tuple[float, torch.Tensor]:
    import tritonclient.grpc as grpcclient
    vectors: list = [None] * len(texts)

    def client(idx: list[int]) -> None:
        with grpcclient.InferenceServerClient(url) as c:
            for i in idx:
                inp = grpcclient.InferInput("embedding_request", [1], "BYTES")
                inp.set_data_from_numpy(np.array([json.dumps({"input": texts[i]}).encode()],
                                                 dtype=np.object_))
                done = threading.Event()
                box = {}

                def cb(result, error, box=box, done=done):
                    box["r"], box["e"] = result, error
                    done.set()
                c.start_stream(cb)
                c.async_stream_infer("llm", inputs=[inp])
                done.wait(600)
                c.stop_stream()
                if box["e"] is not None:
                    raise RuntimeError(box["e"])
                vectors[i] = json.loads(box["r"].as_numpy("text_output")[0])
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(list(range(k, len(texts), clients)),))
               for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, torch.tensor(vectors)


def main(args: argparse.Namespace) -> int:
    from transformers import AutoModel
    n, length, conc, rounds = QUICK if args.quick else FULL
    rounds = args.repeats or rounds
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=64)
    info = bu.run_info(args.threads, args.dtype, str(llm.engine.model_dir))
    hf = AutoModel.from_pretrained(llm.engine.model_dir, dtype=llm.config.torch_dtype).eval()
    server = None
    if args.server:
        from client.server import BenchServer
        server = BenchServer({"num_threads": str(args.threads), "max_num_seqs": "64"},
                             model=args.model)
    res: dict = {"config": dict(vars(args)), "sizes": [n, length, conc], "info": info,
                 "rounds": []}
    try:
        for r in range(rounds):
            texts = bu.make_prompts(n, length, llm.engine.model_config.vocab_size, args.seed + r)
            row, vecs = {}, {}
            kinds = ["hf", "ours"] + (["served"] if server else [])
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                llm.engine.kv.reset_prefix_cache()  # every round's texts computed in full
                if kind == "hf":
                    row["hf_s"], vecs["hf"] = hf_embed(hf, texts, conc)
                elif kind == "ours":
                    row["ours_s"], vecs["ours"] = ours_embed(llm, texts)
                else:
                    row["served_s"], vecs["served"] = served_embed(server.server.grpc_url,
                                                                   texts, conc)
            for k in vecs:
                row[f"{k}_max_diff"] = float((vecs[k] - vecs["hf"]).abs().max())
            res["rounds"].append(row)
    finally:
        if server is not None:
            server.stop()
        llm.close()
    res["report"] = report(res)
    path = bu.write_json(args.out or bu.default_out("embed"), res)
    print(res["report"])
    print(f"\nwrote {path}")
    return 0


def report(res: dict) -> str:
    n, length, conc = res["sizes"]
    rounds = res["rounds"]
    kinds = [k for k in ("hf", "ours", "served") if f"{k}_s" in rounds[0]]
    rows = [[k, bu.fmt_num(statistics.median(n / r[f"{k}_s"] for r in rounds)),
             f"{max(r[f'{k}_max_diff'] for r in rounds):.1e}"] for k in kinds]
    ratios = [bu.ratio_row(f"{k} texts/s / transformers' (median of {len(rounds)})",
                           statistics.median(r["hf_s"] / r[f"{k}_s"] for r in rounds), 1.5, True)
              for k in kinds if k != "hf"]
    return "\n".join([
        bu.header_line(res["info"]), "",
        bu.table(f"{n} texts x {length} tokens, transformers in batches of {conc}, served by "
                 f"{conc} clients", ["", "texts/s", "max |diff| vs transformers"], rows), "",
        bu.ratio_lines(ratios)])
