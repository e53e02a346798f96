"""The fine-tuning parts train_fsdp.py assembles: the typed config (config.py) and which of its changes a resume refuses (resume_rules.py), data (the data/ package), the
model and its sharding (model.py, shards.py), LoRA adapters (lora.py), the checks of a run's inputs before any
process group and how bad input is reported once (inputs.py, launch.py, model_identity.py), the optimizers and
the LR schedule (optim.py, schedule.py), the loss, metrics, per-rank values (per_rank.py) and loggers, evaluation, what a checkpoint holds (checkpoint_contents.py) and the memory planner (plan.py, `train_fsdp.py --plan`).

    python -m pytest tests/test_config.py tests/test_data.py tests/test_model_init.py -q

May import: ckpt/, common/, torch, transformers, peft and the other third-party packages of requirements.txt.
Never train_fsdp.py (tests/test_layers.py checks it).
"""
