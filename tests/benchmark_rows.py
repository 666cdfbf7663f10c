"""Rows of each benchmark in its hub schema (column names and types as the hub stores them), few enough to
read, with one row of each way a row can fail to be scored."""

from __future__ import annotations

MMLU = {  # cais/mmlu, config "all": answer is a ClassLabel index 0-3
    "test": [
        {
            "question": "What is 2 + 2?",
            "subject": "elementary_mathematics",
            "choices": ["3", "4", "5", "6"],
            "answer": 1,
        },
        {
            "question": "Which organ pumps blood?",
            "subject": "anatomy",
            "choices": ["lung", "liver", "heart", "kidney"],
            "answer": 2,
        },
        {
            "question": "H2O is?",
            "subject": "chemistry",
            "choices": ["water", "salt", "sand", "iron"],
            "answer": 0,
        },
        {  # longer than the tiny model's context (512 tokens): excluded over the context
            "question": "Read the passage, then name its topic. " + "The river runs past the old mill. " * 60,
            "subject": "reading",
            "choices": ["rivers", "mills", "roads", "hills"],
            "answer": 0,
        },
        {"question": "Pick one.", "subject": "misc", "choices": ["a", "b"], "answer": 5},  # no such option
    ]
}
MMLU_FEATURES = {"question": "string", "subject": "string", "choices": ["string"], "answer": "int64"}

MEDMCQA = {  # openlifescienceai/medmcqa: cop 0-3 on train/validation, -1 on test (no gold)
    "validation": [
        {
            "id": "m-1",
            "question": "Vitamin deficient in scurvy?",
            "opa": "A",
            "opb": "B12",
            "opc": "C",
            "opd": "D",
            "cop": 2,
            "choice_type": "single",
            "exp": "Scurvy is vitamin C deficiency.",
            "subject_name": "Biochemistry",
            "topic_name": None,
        },
        {
            "id": "m-2",
            "question": "Largest bone?",
            "opa": "Femur",
            "opb": "Tibia",
            "opc": "Humerus",
            "opd": "Radius",
            "cop": 0,
            "choice_type": "single",
            "exp": None,
            "subject_name": "Anatomy",
            "topic_name": None,
        },
    ],
    "test": [
        {
            "id": "m-3",
            "question": "Drug of choice for X?",
            "opa": "a",
            "opb": "b",
            "opc": "c",
            "opd": "d",
            "cop": -1,
            "choice_type": "single",
            "exp": None,
            "subject_name": "Pharmacology",
            "topic_name": None,
        },
    ],
}
MEDMCQA_FEATURES = {
    "id": "string",
    "question": "string",
    "opa": "string",
    "opb": "string",
    "opc": "string",
    "opd": "string",
    "cop": "int64",
    "choice_type": "string",
    "exp": "string",
    "subject_name": "string",
    "topic_name": "string",
}

GPQA = {  # Idavidrein/gpqa, config gpqa_diamond: one split, "train"
    "train": [
        {
            "Record ID": f"rec{i}",
            "Question": f"Question {i}?",
            "Correct Answer": f"right {i}",
            "Incorrect Answer 1": f"wrong {i}a",
            "Incorrect Answer 2": f"wrong {i}b",
            "Incorrect Answer 3": f"wrong {i}c",
            "Explanation": "because",
            "High-level domain": domain,
            "Subdomain": "x",
        }
        for i, domain in enumerate(["Physics", "Chemistry", "Biology", "Physics", "Chemistry", "Biology"])
    ]
}

HLE = {  # cais/hle: image "" on text-only rows
    "test": [
        {
            "id": "h-1",
            "question": "What is the smallest prime?",
            "image": "",
            "image_preview": None,
            "answer": "2",
            "answer_type": "exactMatch",
            "author_name": "a",
            "rationale": "2 is prime.",
            "rationale_image": None,
            "raw_subject": "Math",
            "category": "Math",
            "canary": "c",
        },
        {
            "id": "h-2",
            "question": "Which is a noble gas?\n\nAnswer Choices:\nA. Neon\nB. Iron\nC. Salt",
            "image": "",
            "image_preview": None,
            "answer": "A",
            "answer_type": "multipleChoice",
            "author_name": "a",
            "rationale": "",
            "rationale_image": None,
            "raw_subject": "Chemistry",
            "category": "Chemistry",
            "canary": "c",
        },
        {
            "id": "h-3",
            "question": "What does the figure show?",
            "image": "data:image/png;base64,iVBORw0KGgo=",
            "image_preview": None,
            "answer": "a cat",
            "answer_type": "exactMatch",
            "author_name": "a",
            "rationale": "",
            "rationale_image": None,
            "raw_subject": "Biology",
            "category": "Biology/Medicine",
            "canary": "c",
        },
    ]
}
HLE_FEATURES = {"image_preview": "string", "rationale_image": "string"}

MMLU_PRO = {  # TIGER-Lab/MMLU-Pro: up to 10 options, answer letter + answer_index
    "test": [
        {
            "question_id": 70,
            "question": "Pick the even number.",
            "options": ["1", "3", "5", "7", "9", "11", "13", "15", "16", "17"],
            "answer": "I",
            "answer_index": 8,
            "cot_content": "A: Let's think step by step. 16 is even.",
            "category": "math",
            "src": "x",
        },
    ]
}

MATH500 = {  # HuggingFaceH4/MATH-500
    "test": [
        {
            "problem": "Compute 1/2 + 1/4.",
            "solution": r"It is $\boxed{\frac{3}{4}}$.",
            "answer": r"\frac{3}{4}",
            "subject": "Prealgebra",
            "level": 1,
            "unique_id": "test/prealgebra/1.json",
        },
        {
            "problem": "Solve x + 1 = 4.",
            "solution": r"$x = \boxed{3}$",
            "answer": "3",
            "subject": "Algebra",
            "level": 1,
            "unique_id": "test/algebra/2.json",
        },
    ]
}

AIME = {  # HuggingFaceH4/aime_2024
    "train": [
        {"id": 60, "problem": "Find 7 * 6.", "solution": "42", "answer": "42", "url": "u", "year": "2024"},
    ]
}

OLYMPIADBENCH = {  # Hothan/OlympiadBench: final_answer a list; images on multimodal rows; proofs have none
    "train": [
        {
            "id": 1,
            "question": "Find all x with x^2 = 4.",
            "solution": ["..."],
            "final_answer": ["2", "-2"],
            "context": None,
            "image_1": None,
            "image_2": None,
            "image_3": None,
            "image_4": None,
            "image_5": None,
            "modality": "Text-only",
            "difficulty": "Competition",
            "is_multiple_answer": True,
            "unit": None,
            "answer_type": "Numerical",
            "error": None,
            "question_type": "Open-ended",
            "subfield": "Algebra",
            "subject": "Math",
            "language": "English",
        },
        {
            "id": 2,
            "question": "Prove that there are infinitely many primes.",
            "solution": ["..."],
            "final_answer": None,
            "context": None,
            "image_1": None,
            "image_2": None,
            "image_3": None,
            "image_4": None,
            "image_5": None,
            "modality": "Text-only",
            "difficulty": "Competition",
            "is_multiple_answer": False,
            "unit": None,
            "answer_type": None,
            "error": None,
            "question_type": "Theorem proof",
            "subfield": "Number Theory",
            "subject": "Math",
            "language": "English",
        },
        {
            "id": 3,
            "question": "In the figure, find the angle.",
            "solution": ["..."],
            "final_answer": ["30"],
            "context": None,
            "image_1": "<image>",
            "image_2": None,
            "image_3": None,
            "image_4": None,
            "image_5": None,
            "modality": "Multimodal",
            "difficulty": "Competition",
            "is_multiple_answer": False,
            "unit": "degrees",
            "answer_type": "Numerical",
            "error": None,
            "question_type": "Open-ended",
            "subfield": "Geometry",
            "subject": "Math",
            "language": "English",
        },
    ]
}
OLYMPIADBENCH_FEATURES = {
    "final_answer": ["string"],
    "context": "string",
    "unit": "string",
    "error": "string",
    "answer_type": "string",
    **{f"image_{i}": "string" for i in range(1, 6)},
}

# repo id (with config), rows by split, features
HUB = {
    "cais/mmlu/all": (MMLU, MMLU_FEATURES),
    "openlifescienceai/medmcqa": (MEDMCQA, MEDMCQA_FEATURES),
    "Idavidrein/gpqa/gpqa_diamond": (GPQA, None),
    "cais/hle": (HLE, HLE_FEATURES),
    "TIGER-Lab/MMLU-Pro": (MMLU_PRO, None),
    "HuggingFaceH4/MATH-500": (MATH500, None),
    "HuggingFaceH4/aime_2024": (AIME, None),
    "Hothan/OlympiadBench": (OLYMPIADBENCH, OLYMPIADBENCH_FEATURES),
}


def write_all(home) -> None:
    """Every set above into the hub cache under ``home``, as a cluster's cache holds them: once per content
    (a marker names its hash), under a lock, so test files on two workers never rewrite what the other
    reads."""
    import hashlib
    import json
    from pathlib import Path

    from filelock import FileLock
    from hub_datasets import write_hub_dataset

    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(json.dumps(HUB, sort_keys=True, default=str).encode()).hexdigest()[:16]
    marker = home / f"benchmark-fixtures-{digest}.done"
    with FileLock(str(home / "benchmark-fixtures.lock")):
        if marker.is_file():
            return
        for spec, (splits, features) in HUB.items():
            parts = spec.split("/")
            write_hub_dataset(
                home, "/".join(parts[:2]), splits, parts[2] if len(parts) > 2 else None, features
            )
        marker.write_text(digest)
