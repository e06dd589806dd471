"""``python -m train.trees``: label tree rounds, train what reads those labels, and price trees offline.

For each decoding mode (greedy, T = 1) of a bundle's pair:

1. **Labels.** Decode the training prompts with a wide collection tree (EAGLE-2's rule, so every round verifies
   many nodes) and keep every round whole (:class:`~accept_head.trees.labels.LabelledRound`): the label of each node
   whose parent the target scored, P(node accepted | parent accepted) under the tree verification rule. The same on
   separate check prompts. Rounds are cached per prompt set (``rounds-<set>.pt``), so a rerun resumes.
2. **Fit.** A C2T classifier on the training nodes (:class:`~accept_head.trees.labels.C2TClassifier`), a *tree
   head*: the bundle's acceptance head fine-tuned with BCE on the training nodes it scores (:func:`head_nodes`: the
   fed ones for a head that reads the hidden state, every labelled node for one that reads only the draft's numbers)
   — the second head of "one head for chains and trees, or one each" — and a *hidden-only head*, the SpecDec++
   paper's (the hidden state alone, the bundle head's depth), trained from scratch with the same settings on the fed
   training nodes (:func:`fit_hidden_head`).
3. **Check** (prompts that trained nothing): per scorer — the node's own draft probability q, EAGLE-2's path score
   (the joint draft probability of the node's path), AdaEDL's entropy bound 1 − sqrt(γ H) (γ = 0.2, ``EntropyStop``'s
   default), the bundle's chain head (with its calibration for the mode), the tree head, the hidden-only head, C2T
   and the labels themselves (the oracle) — the BCE, ECE, Brier score and AUC on the labelled fed nodes (and on all
   labelled nodes for the scorers that score every node), and the trees
   each would verify: in every check round, the subtree of the labelled nodes
   with the best expected tokens per second under the cost model when values are the scorer's path products
   (:func:`~accept_head.trees.growth.best_subtree`), scored with the *true* values. The oracle's is the ceiling of
   the tree a perfect head would pick from those drafted nodes.

4. **Tree calibration.** An isotonic map from the bundle's head probability to the node labels, fitted on the
   training rounds per mode: the chain calibration maps to chain labels (min(1, p/q) at T = 1), while a tree node is
   accepted with probability p(token). Checked on the check rounds beside the chain calibration (ECE, BCE), and with
   ``export_calibration`` written into the bundle (``tree_calibration``), where ``generate(tree=True)`` and
   ``eval bench``'s ``head_tree`` read it.

Writes ``<output_dir>/<mode>/`` (``c2t.safetensors``, ``head.safetensors``: load with
:meth:`~accept_head.trees.labels.TreeModels.load`, pass to ``eval bench --tree_models``; ``tree_calibration.json``)
and ``trees.json``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from pathlib import Path

import torch
from sklearn.metrics import roc_auc_score

from ..acceptance.calibration import Calibration, fit_isotonic
from ..acceptance.head import AcceptanceHead
from ..acceptance.metrics import expected_calibration_error
from ..chain.baselines import entropy_lower_bound
from ..core.costs import CostModel
from ..core.prompts import PromptOptions, PromptSource, check_disjoint
from ..core.records import machine_info, write_json
from ..core.sampling import SamplingConfig
from ..core.seeds import seeded_generator
from ..models.loading import weights_digest
from ..specdecpp.bundle import SpecDecPP
from ..trees.decoding import tree_generate
from ..trees.growth import ConfidenceTree, best_subtree
from ..trees.labels import C2TClassifier, LabelledRound, TreeLabelRecorder, TreeModels, tree_mode


def collect_rounds(
    bundle: SpecDecPP, prompts, rule, temperature: float, max_new_tokens: int, seed: int
) -> list[LabelledRound]:
    """Decode ``prompts`` over trees grown by ``rule`` and return every round, labelled (decoding past EOS, so every
    prompt gives ``max_new_tokens`` tokens of rounds)."""
    recorder = TreeLabelRecorder(SamplingConfig(temperature))
    for index, prompt in enumerate(prompts):
        tree_generate(
            bundle.target,
            bundle.draft,
            list(prompt.ids),
            rule,
            max_new_tokens,
            temperature,
            generator=seeded_generator(seed, 0, index),
            observe=recorder.observe,
        )
    return recorder.rounds


def _label_rounds(
    folder: Path, bundle: SpecDecPP, prompt_sets: tuple, rule, temperature: float, max_new_tokens: int, seed: int
) -> tuple[list[LabelledRound], list[LabelledRound]]:
    """The labelled rounds of the training and the check prompt set (decoded with seeds ``seed`` and ``seed + 1``),
    each cached in ``folder`` as ``rounds-<set>.pt`` so a rerun resumes."""
    train_set, check_set = prompt_sets
    made_by = {  # what the rounds depend on: a cache made otherwise (another draft's weights, say) is collected anew
        "target": bundle.target_spec.to_dict() if bundle.target_spec else None,
        "draft": bundle.draft_spec.to_dict() if bundle.draft_spec else None,
        "draft_weights": weights_digest(bundle.draft_spec.path) if bundle.draft_spec else None,
        "rule": rule.describe(),
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
    }
    train = _cached_rounds(
        folder / "rounds-train.pt",
        lambda: collect_rounds(bundle, train_set.prompts, rule, temperature, max_new_tokens, seed),
        {**made_by, "prompts": [list(p.ids) for p in train_set.prompts], "seed": seed},
    )
    check = _cached_rounds(
        folder / "rounds-check.pt",
        lambda: collect_rounds(bundle, check_set.prompts, rule, temperature, max_new_tokens, seed + 1),
        {**made_by, "prompts": [list(p.ids) for p in check_set.prompts], "seed": seed + 1},
    )
    return train, check


def _cached_rounds(path: Path, make, made_by: dict) -> list[LabelledRound]:
    """The rounds stored at ``path`` when they were made by ``made_by`` (recorded beside them, hashed), or ``make()``'s
    (then stored there, whole or not at all)."""
    key = hashlib.sha256(json.dumps(made_by, sort_keys=True, default=str).encode()).hexdigest()
    key_path = path.with_suffix(".key")
    if path.is_file() and key_path.is_file() and key_path.read_text().strip() == key:
        return [LabelledRound(**raw) for raw in torch.load(path, weights_only=True)]
    if path.is_file():
        print(f"{path}: made by another draft, target, rule or prompt set (or before keys were kept); collecting anew")
    key_path.unlink(missing_ok=True)
    rounds = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save([r.__dict__ for r in rounds], tmp)
    tmp.replace(path)  # whole or absent: a killed run recollects
    key_path.write_text(key + "\n")  # after the rounds: a run killed between the two collects again
    return rounds


def fit_tree_head(
    head: AcceptanceHead, rounds: list[LabelledRound], epochs: int, lr: float, batch_size: int, seed: int
) -> AcceptanceHead:
    """A copy of ``head`` fine-tuned with BCE (soft labels, Adam) on the labelled nodes of ``rounds`` it scores
    (:func:`_head_rows`: the fed ones for a head that reads the hidden state, all of them for a scalar-only head)."""
    hidden, scalars, y = _head_rows(head, rounds)
    if len(y) == 0:
        raise ValueError("no fed, labelled tree node to train a head on: collect more rounds (more prompts/tokens).")
    tuned = copy.deepcopy(head).float().train()
    optimizer = torch.optim.Adam(tuned.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=generator).split(batch_size):
            optimizer.zero_grad()
            logits = tuned(None if hidden is None else hidden[batch], None if scalars is None else scalars[batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[batch])
            loss.backward()
            optimizer.step()
    return tuned.eval()


def fit_hidden_head(
    hidden_size: int, depth: int, rounds: list[LabelledRound], epochs: int, lr: float, batch_size: int, seed: int
) -> AcceptanceHead:
    """The SpecDec++ paper's head (the hidden state alone, ``depth`` blocks), initialised from ``seed`` and trained
    by :func:`fit_tree_head` on the fed, labelled nodes of ``rounds``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = AcceptanceHead(hidden_size, depth)
    return fit_tree_head(head, rounds, epochs, lr, batch_size, seed)


def head_nodes(head: AcceptanceHead, r: LabelledRound) -> list[int]:
    """The labelled nodes of ``r`` that ``head`` scores in a :class:`~accept_head.trees.growth.HeadTree`: the fed
    ones when it reads the hidden state, every one when it reads only scalar inputs."""
    return [n for n in r.labelled() if n in r.hidden or not head.reads_hidden]


def _head_rows(
    head: AcceptanceHead, rounds: list[LabelledRound]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(hidden (N, d) or None, scalar inputs (N, S) or None, labels (N,)) of the nodes ``head`` scores."""
    nodes = [(r, n) for r in rounds for n in head_nodes(head, r)]
    hidden = scalars = None
    if head.reads_hidden:
        hidden = torch.stack([r.hidden[n].float() for r, n in nodes]) if nodes else torch.zeros(0, head.hidden_size)
    if head.scalar_inputs:
        rows = [r.inputs(n, head.scalar_inputs) for r, n in nodes]
        scalars = torch.tensor(rows, dtype=torch.float32).reshape(len(nodes), len(head.scalar_inputs))
    return hidden, scalars, torch.tensor([r.labels[n] for r, n in nodes], dtype=torch.float32)


def _fed_rows(rounds: list[LabelledRound]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [(r.hidden[n], r.labels[n]) for r in rounds for n in r.labelled() if n in r.hidden]
    if not rows:
        return torch.zeros(0), torch.zeros(0)
    return torch.stack([h.float() for h, _ in rows]), torch.tensor([label for _, label in rows])


def soft_auc(labels: list[float], scores: list[float]) -> float | None:
    """ROC AUC with soft labels: a node of label y counts as a positive of weight y and a negative of weight 1 − y."""
    if not labels or not 0 < sum(labels) < len(labels):
        return None
    y = [1] * len(labels) + [0] * len(labels)
    weights = [*labels, *(1 - v for v in labels)]
    return float(roc_auc_score(y, [*scores, *scores], sample_weight=weights))


def bce(labels: list[float], scores: list[float]) -> float:
    eps = 1e-6
    terms = [y * math.log(max(p, eps)) + (1 - y) * math.log(max(1 - p, eps)) for y, p in zip(labels, scores)]
    return -sum(terms) / max(len(terms), 1)


def brier(labels: list[float], scores: list[float]) -> float:
    """The Brier score with soft labels: mean (score − label)²."""
    return sum((p - y) ** 2 for y, p in zip(labels, scores)) / max(len(labels), 1)


def head_scorer(head: AcceptanceHead, calibrated=None):
    """function(round) → {labelled node: score} of ``head`` (through ``calibrated`` when given) on the nodes a
    :class:`~accept_head.trees.growth.HeadTree` scores with it (:func:`head_nodes`); any other node counts its draft
    probability, as there."""
    head = copy.deepcopy(head).float().eval()  # once, not per round; the caller's head is left as it is

    def score(r: LabelledRound) -> dict[int, float]:
        out = {n: r.probs[n] for n in r.labelled()}
        hidden, scalars, labels = _head_rows(head, [r])
        if len(labels):
            with torch.inference_mode():
                probs = head.accept_prob(hidden, scalars).tolist()
            out |= {n: float(calibrated(p)) if calibrated else p for n, p in zip(head_nodes(head, r), probs)}
        return out

    return score


HIDDEN_ONLY = "hidden-only head"
"""The scorer name of the SpecDec++ paper's head (:func:`fit_hidden_head`): it scores fed nodes only."""
ENTROPY_GAMMA = 0.2
"""γ of AdaEDL's entropy bound among the scorers: :class:`~accept_head.chain.baselines.EntropyStop`'s default."""
ENTROPY_BOUND = f"entropy bound (AdaEDL, γ={ENTROPY_GAMMA:g})"


def scorers(
    bundle: SpecDecPP,
    models: TreeModels,
    greedy: bool,
    tree_calibration: Calibration | None = None,
    hidden_head: AcceptanceHead | None = None,
) -> dict:
    """Scorer name → function(round) → {labelled node: score}. Head scorers score the nodes a
    :class:`~accept_head.trees.growth.HeadTree` would (:func:`head_nodes`) and count any other node's draft
    probability, as it does. ``draft probability q`` is the node's own q; ``path probability (EAGLE-2)`` the joint
    q of its path (EAGLE-2's score); :data:`ENTROPY_BOUND` 1 − sqrt(γ H) of the distribution it was drawn from
    (γ = :data:`ENTROPY_GAMMA`; negative for H > 1/γ, counted as 0 by :func:`node_metrics`). ``chain head`` maps
    the head through the chain calibration of the mode; ``chain head, tree calibration`` (when given one) through
    ``tree_calibration``; :data:`HIDDEN_ONLY` (when given ``hidden_head``) is raw."""
    calibration = bundle.calibration_for(greedy)

    def c2t(r: LabelledRound) -> dict[int, float]:
        nodes = r.labelled()
        if not nodes:
            return {}
        with torch.inference_mode():
            probs = torch.sigmoid(models.classifier(greedy)(torch.tensor([r.features[n] for n in nodes]))).tolist()
        return dict(zip(nodes, probs))

    return {
        "oracle (true labels)": lambda r: {n: r.labels[n] for n in r.labelled()},
        "draft probability q": lambda r: {n: r.probs[n] for n in r.labelled()},
        "path probability (EAGLE-2)": lambda r: {n: math.exp(r.features[n][0]) for n in r.labelled()},
        ENTROPY_BOUND: lambda r: {n: entropy_lower_bound(r.features[n][1], ENTROPY_GAMMA) for n in r.labelled()},
        "chain head": head_scorer(bundle.head, calibration),
        **({"chain head, tree calibration": head_scorer(bundle.head, tree_calibration)} if tree_calibration else {}),
        "tree head": head_scorer(models.head(greedy), None),
        **({HIDDEN_ONLY: head_scorer(hidden_head, None)} if hidden_head is not None else {}),
        "C2T": c2t,
    }


def fit_tree_calibration(head: AcceptanceHead, rounds: list[LabelledRound]) -> Calibration:
    """An isotonic map from ``head``'s raw acceptance probability to the node labels of ``rounds`` (the nodes a
    :class:`~accept_head.trees.growth.HeadTree` scores with it, :func:`head_nodes`)."""
    hidden, scalars, labels = _head_rows(head, rounds)
    if len(labels) == 0:
        raise ValueError("no labelled tree node the head scores to calibrate on: collect more rounds.")
    with torch.inference_mode():
        probs = copy.deepcopy(head).float().eval().accept_prob(hidden, scalars)
    return fit_isotonic(probs, labels)


def price_trees(rounds: list[LabelledRound], score, cost: CostModel, max_nodes: int) -> dict:
    """The trees ``score`` would verify from each round's labelled nodes (best expected tokens/s by its own values),
    scored with the true values: mean expected tokens per round and expected tokens per second."""
    tokens = seconds = size = 0.0
    for r in rounds:
        nodes = r.labelled()
        index = {n: i for i, n in enumerate(nodes)}
        parents = [index.get(r.parents[n], -1) for n in nodes]
        scores = score(r)
        values, truth = [], []
        for i, n in enumerate(nodes):
            p = parents[i]
            values.append((1.0 if p < 0 else values[p]) * min(max(scores[n], 0.0), 1.0))
            truth.append((1.0 if p < 0 else truth[p]) * r.labels[n])
        chosen, _ = best_subtree(parents, values, cost, max_nodes)
        depths = [1] * len(nodes)
        for i, p in enumerate(parents):
            depths[i] = 1 if p < 0 else depths[p] + 1
        tokens += 1 + sum(truth[i] for i in chosen)
        seconds += cost.drafting(max((depths[i] for i in chosen), default=0)) + cost.t_target(len(chosen))
        size += len(chosen)
    n = max(len(rounds), 1)
    return {
        "expected_tokens_per_round": tokens / n,
        "expected_tokens_per_second": tokens / seconds if seconds else 0.0,
        "mean_tree_size": size / n,
    }


def top_children(r: LabelledRound) -> set[int]:
    """Each parent's child of highest draft probability (the node a greedy chain would have drafted there)."""
    best: dict[int, int] = {}
    for n, parent in enumerate(r.parents):
        if parent not in best or r.probs[n] > r.probs[best[parent]]:
            best[parent] = n
    return set(best.values())


def node_metrics(rounds: list[LabelledRound], score, fed_only: bool, top_only: bool = False) -> dict:
    """BCE, ECE, Brier score, soft AUC, mean score and mean label of ``score`` (clipped to [0, 1]) over the labelled
    nodes of ``rounds`` (only the fed ones with ``fed_only``; only each parent's top child with ``top_only``)."""
    labels, scores = [], []
    for r in rounds:
        s = score(r)
        top = top_children(r) if top_only else None
        for n in r.labelled():
            if (not fed_only or n in r.hidden) and (top is None or n in top):
                labels.append(r.labels[n])
                scores.append(min(max(s[n], 0.0), 1.0))
    return {
        "nodes": len(labels),
        "bce": bce(labels, scores),
        "ece": expected_calibration_error(torch.tensor(scores), torch.tensor(labels)) if labels else None,
        "brier": brier(labels, scores),
        "auc": soft_auc(labels, scores),
        "mean_score": sum(scores) / max(len(scores), 1),
        "mean_label": sum(labels) / max(len(labels), 1),
    }


def run(
    bundle: str,
    prompts: list[PromptSource],
    check_prompts: list[PromptSource],
    output_dir: str = "eval_out/trees",
    temperatures: list[float] | None = None,
    max_new_tokens: int = 48,
    collect: dict | None = None,
    cost_model: str = "bundle",
    max_nodes: int = 48,
    head_epochs: int = 4,
    head_lr: float = 1e-4,
    head_batch_size: int = 256,
    c2t_steps: int = 500,
    prompt_options: PromptOptions | None = None,
    dtype: str | None = None,
    threads: int | None = None,
    seed: int = 0,
    export_calibration: bool = False,
) -> dict:
    """Label tree rounds, fit the C2T classifier, the tree head and the tree calibration, and check them against the
    chain head and the oracle (see the module docstring).

    Args:
        bundle: A SpecDec++ bundle folder (its pair, head, calibrations and cost model).
        prompts: Training prompt sources (labels for fitting); must not overlap ``check_prompts`` nor any prompts a
            result is reported on.
        check_prompts: Prompt sources whose rounds only measure (BCE, AUC, priced trees).
        output_dir: Where the models, the cached rounds and ``trees.json`` go.
        temperatures: Decoding temperatures; 0 is greedy (one mode each). Default [0, 1].
        max_new_tokens: Tokens decoded per prompt (past EOS).
        collect: ``ConfidenceTree`` settings of the collection tree (default width 4, top_k 4, depth 5, 48 nodes).
        cost_model: ``bundle`` or a ``costs.json`` of ``python -m eval costs``: prices the offline trees.
        max_nodes: Largest tree priced offline.
        head_epochs / head_lr / head_batch_size: The tree head's fine-tuning.
        c2t_steps: Full-batch Adam steps of the C2T classifier.
        prompt_options: How prompts are encoded.
        dtype: Load the pair in this dtype (default: the bundle's).
        threads: torch threads (default: torch's).
        seed: Seed of prompt order and decoding generators.
        export_calibration: Write the tree calibrations into ``bundle`` (its ``config.json`` and model card), for
            ``generate(tree=True)`` and ``eval bench``'s ``head_tree``.
    """
    if threads:
        torch.set_num_threads(threads)
    temperatures = _checked_options(temperatures, max_nodes, cost_model)
    rule = ConfidenceTree(**{"width": 4, "top_k": 4, "max_depth": 5, "max_nodes": 48, **(collect or {})})
    folder = Path(output_dir)
    specdec = SpecDecPP.from_pretrained(bundle, **({"dtype": dtype} if dtype else {}))
    prompt_sets = _prompt_sets(specdec, prompts, check_prompts, prompt_options or PromptOptions(), seed)
    cost = _cost_model(specdec, cost_model)
    models, results, calibrations = TreeModels(), {}, {}
    for temperature in temperatures:
        greedy, mode = temperature == 0, tree_mode(temperature == 0)
        start = time.perf_counter()
        # 1. Label: every round of the collection tree, on the training and on the check prompts (cached per set).
        train, check = _label_rounds(folder / mode, specdec, prompt_sets, rule, temperature, max_new_tokens, seed)
        # 2. Fit the C2T classifier and the tree head on the training rounds.
        labelled = [(r.features[n], r.labels[n]) for r in train for n in r.labelled()]
        models.c2t[mode] = C2TClassifier.fit([f for f, _ in labelled], [y for _, y in labelled], c2t_steps, seed)
        models.heads[mode] = fit_tree_head(specdec.head, train, head_epochs, head_lr, head_batch_size, seed)
        calibrations[mode] = fit_tree_calibration(specdec.head, train)
        head = specdec.head
        hidden_head = fit_hidden_head(head.hidden_size, head.depth, train, head_epochs, head_lr, head_batch_size, seed)
        # 3. Check every scorer on the check rounds: its BCE, ECE, Brier and AUC, and the trees it would verify.
        table = scorers(specdec, models, greedy, calibrations[mode], hidden_head)
        fed_only = tuple(name for name in table if name == HIDDEN_ONLY or ("head" in name and head.reads_hidden))
        checked = _check_results(train, check, table, cost, max_nodes, fed_only)
        results[mode] = {"temperature": temperature, **checked, "seconds": time.perf_counter() - start}
        print(_summary(mode, results[mode]), flush=True)
    # 4. Write the models, the calibrations (into the bundle too when asked) and trees.json.
    _write_models(folder, models, calibrations)
    if export_calibration:
        _export_calibrations(bundle, calibrations, results, prompt_sets)
    settings = {"max_new_tokens": max_new_tokens, "max_nodes": max_nodes, "head_epochs": head_epochs}
    settings |= {"head_lr": head_lr, "c2t_steps": c2t_steps, "seed": seed, "dtype": dtype}
    payload = _payload(bundle, rule, prompt_sets, settings, {"source": cost_model, **cost.to_dict()}, results)
    write_json(folder / "trees.json", payload)
    print(f"wrote {folder / 'trees.json'} and the models under {folder}/<mode>/")
    return payload


def _payload(bundle: str, rule: ConfidenceTree, prompt_sets, settings: dict, cost: dict, results: dict) -> dict:
    """What ``trees.json`` records: the machine, the bundle, the collection tree, both prompt sets, the settings,
    the cost model and each mode's results."""
    payload = {"command": "train.trees", "machine": machine_info(), "bundle": str(bundle)}
    payload |= {"collection_tree": rule.describe(), "prompts": prompt_sets[0].describe()}
    payload |= {"check_prompts": prompt_sets[1].describe(), "settings": settings}
    return payload | {"cost_model": cost, "results": results}


def _write_models(folder: Path, models: TreeModels, calibrations: dict[str, Calibration]) -> None:
    """The tree models and, per mode, ``tree_calibration.json``."""
    models.save(folder)
    for mode, calibration in calibrations.items():
        write_json(folder / mode / "tree_calibration.json", calibration.to_dict())


def _export_calibrations(bundle: str, calibrations: dict[str, Calibration], results: dict, prompt_sets) -> None:
    """Write the tree calibrations, how they were fitted and checked, and a model-card section into ``bundle``."""
    record = _calibration_record(results, prompt_sets[0].describe()["ids"], prompt_sets[1].describe()["ids"])
    SpecDecPP.write_tree_calibration(bundle, calibrations, record, _calibration_card(record))
    print(f"wrote the tree calibrations into {bundle}")


def _calibration_record(results: dict, train_ids: list[str], check_ids: list[str]) -> dict:
    """What the bundle records of its tree calibrations: the command, the prompts, and per mode the check rounds'
    ECE / BCE / AUC of the head through the chain calibration and through the tree calibration."""
    record = {"command": "python -m train.trees --export_calibration true", "method": "isotonic"}
    record |= {"prompts": train_ids, "check_prompts": check_ids, "modes": {}}
    for mode, result in results.items():
        checked = {"labelled_nodes_train": result["labelled_nodes"]["train"]}
        for key, name in (("chain", "chain head"), ("tree", "chain head, tree calibration")):
            metrics = result["fed_nodes"][name]
            checked[key] = {k: metrics[k] for k in ("nodes", "ece", "bce", "auc", "mean_score", "mean_label")}
        record["modes"][mode] = checked
    return record


def _calibration_card(record: dict) -> str:
    """The model card's section on the tree calibrations (from :func:`_calibration_record`)."""
    lines = [
        "## Tree calibration",
        "",
        "`generate(tree=True)` prices each node with the head's probability mapped by an isotonic fit on tree-node "
        "labels, P(node accepted | parent accepted), per decoding mode: at T = 1 that is the target's p(token), not a "
        f"chain candidate's min(1, p/q). Fitted by `{record['command']}` on the tree rounds of "
        f"{len(record['prompts'])} prompts; checked on {len(record['check_prompts'])} other prompts' fed nodes:",
        "",
        "| mode | training nodes | check nodes | ECE, chain map | ECE, tree map | BCE, chain map | BCE, tree map |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in record["modes"].items():
        lines.append(
            f"| {mode} | {m['labelled_nodes_train']} | {m['tree']['nodes']} | {m['chain']['ece']:.3f} | "
            f"{m['tree']['ece']:.3f} | {m['chain']['bce']:.3f} | {m['tree']['bce']:.3f} |"
        )
    return "\n".join(lines)


def _prompt_sets(specdec: SpecDecPP, prompts, check_prompts, options: PromptOptions, seed: int) -> tuple:
    """The encoded training and check prompt sets; ValueError when they share a prompt."""
    train_set = options.encode("tree-train", prompts, specdec.tokenizer, seed)
    check_set = options.encode("tree-check", check_prompts, specdec.tokenizer, seed)
    check_disjoint(train_set, check_set)  # by tokens: the same file under another `name` gives other ids
    return train_set, check_set


def _checked_options(temperatures: list[float] | None, max_nodes: int, cost_model: str) -> list[float]:
    """:func:`run`'s temperatures (default [0, 1]), after a ValueError (FileNotFoundError for ``cost_model``) naming
    a bad option, before any model loads: each temperature finite and >= 0, one per mode (greedy, sampled: two sampled
    ones would share the mode's models and results, the later overwriting the earlier), ``max_nodes`` >= 1,
    ``cost_model`` ``bundle`` or a file."""
    temperatures = [0.0, 1.0] if temperatures is None else [float(t) for t in temperatures]
    for temperature in temperatures:
        SamplingConfig(temperature)
    modes = [tree_mode(t == 0) for t in temperatures]
    if not temperatures or len(set(modes)) < len(modes):
        raise ValueError(
            f"temperatures={temperatures} must name each mode at most once (0 for greedy, one T > 0 for sampled): "
            "the tree models and results are kept per mode. Run again with another output_dir for another T."
        )
    if max_nodes < 1:
        raise ValueError(f"max_nodes={max_nodes} must be >= 1 (the largest tree priced offline).")
    if cost_model != "bundle" and not Path(cost_model).is_file():
        raise FileNotFoundError(
            f"cost_model={cost_model!r} is neither 'bundle' nor a file: pass a costs.json of `python -m eval costs`."
        )
    return temperatures


def _cost_model(specdec: SpecDecPP, cost_model: str) -> CostModel:
    """The cost model that prices the offline trees: the bundle's (``bundle``) or a ``costs.json`` file's."""
    if cost_model == "bundle":
        return CostModel.from_dict(specdec.cost_model)
    return CostModel.from_dict(json.loads(Path(cost_model).read_text()))


def _check_results(
    train: list[LabelledRound],
    check: list[LabelledRound],
    table: dict,
    cost: CostModel,
    max_nodes: int,
    fed_only: tuple[str, ...] = (),
) -> dict:
    """The counts of ``train`` and ``check`` rounds and, per scorer of ``table``, its metrics on the check rounds'
    nodes and the trees it would verify (the ``results`` of trees.json, less temperature and seconds). The scorers
    named in ``fed_only`` (heads that read the hidden state) stay out of the ``all_nodes`` metrics."""
    return {
        "rounds": {"train": len(train), "check": len(check)},
        "labelled_nodes": {"train": sum(len(r.labelled()) for r in train), "check": sum(len(r.labels) for r in check)},
        "fed_labelled_nodes": {"train": len(_fed_rows(train)[1]), "check": len(_fed_rows(check)[1])},
        "fed_nodes": {name: node_metrics(check, score, fed_only=True) for name, score in table.items()},
        # The nodes a chain drafts (each parent's top child): where the chain head was trained.
        "fed_top_children": {
            name: node_metrics(check, score, fed_only=True, top_only=True) for name, score in table.items()
        },
        "all_nodes": {
            name: node_metrics(check, score, fed_only=False)
            for name, score in table.items()
            if name not in fed_only  # they fall back to q off the fed nodes
        },
        "priced_trees": {name: price_trees(check, score, cost, max_nodes) for name, score in table.items()},
    }


def _summary(mode: str, result: dict) -> str:
    lines = [f"{mode}: {result['rounds']['check']} check rounds, {result['labelled_nodes']['check']} labelled nodes"]
    for name, priced in result["priced_trees"].items():
        fed = result["fed_nodes"][name]
        auc = "–" if fed["auc"] is None else f"{fed['auc']:.3f}"
        lines.append(
            f"  {name:28s} fed BCE {fed['bce']:.3f} Brier {fed['brier']:.3f} AUC {auc}  "
            f"tree: {priced['expected_tokens_per_round']:.2f} tokens/round, {priced['mean_tree_size']:.1f} nodes, "
            f"{priced['expected_tokens_per_second']:.2f} tok/s"
        )
    return "\n".join(lines)
