"""Every key of an Axolotl config, in exactly one table: mapped (a rule in rules_*.py carries its value over),
dropped (it changes nothing that is trained here: speed, memory, layout, logging, I/O), approximated (carried over
only with --allow-approx, announced) or refused (it cannot be carried over faithfully; the reason says what to do).

A key set to null is unset in Axolotl (it drops None values), so it is skipped whatever its table. A refused or
approximated key whose value is off (false, 0, empty) is unset too. docs/migrating-from-axolotl.md is written from
these tables (scripts/gen_migrating_doc.py), and tests/convert/test_convert.py holds them to Axolotl's schema: every field
name sits in exactly one table, and only OUTSIDE_SCHEMA's keys (dropped: Axolotl ignores them) are no field.
"""

from __future__ import annotations


def _each(names: str, why: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), why)


SPEED = "a kernel or speed option: the same math"
MEMORY = "memory or offloading only: the same math"
LAYOUT = "how the work is split over GPUs: the same math (memory per GPU may differ)"
TRACKER = "experiment tracking (finetune logs to metrics.jsonl, TensorBoard, W&B or MLflow)"
MONITOR = "monitoring during training (generations, benchmarks, profiling): nothing it does is trained"
HUB = "publishing or caching files: nothing that is trained"
INTERNAL = "set by Axolotl or its launcher itself"
LOADING = "a model-loading detail: the same weights"


def _plugin(name: str) -> str:
    return f"read only by Axolotl's {name} plugin, which `plugins` refuses"


def _unless(what: str) -> str:
    return f"only with {what}, which is refused"


# Axolotl key -> the finetune keys it becomes (the rule itself is in rules_*.py; this text is for the docs).
MAPPED: dict[str, str] = {
    "base_model": "model.path",
    "tokenizer_config": "tokenizer.path",
    "tokenizer_use_mistral_common": "tokenizer.backend: mistral_common (Mistral's own library encodes each "
                                    "conversation; assistant turns trained exactly as Axolotl's MistralStrategy)",
    "output_dir": "output_dir",
    "seed": "seed (Axolotl's default 42 written when unset)",
    "sequence_len": "data.max_seq_len (512 when unset; null with processor_type: Axolotl's multimodal collator "
                    "neither truncates nor drops)",
    "sample_packing": "data.packing (false when unset)",
    "excess_length_strategy": "data.truncation: drop (default) or truncate",
    "curriculum_sampling": "true: data.shuffle: false",
    "group_by_length": "data.group_by_length",
    "val_set_size": "a fraction: data.val_fraction; a count of rows is refused",
    "datasets": "datasets (each entry: see the dataset keys)",
    "test_datasets": "eval_datasets",
    "micro_batch_size": "train.micro_batch_size (1 when unset)",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps (1 when unset)",
    "batch_size": "train.gradient_accumulation_steps = batch_size // micro_batch_size",
    "num_epochs": "train.epochs (whole numbers)",
    "max_steps": "train.max_steps, with train.epochs: null (Axolotl runs max_steps, epochs or not)",
    "learning_rate": "train.lr (5e-5, Hugging Face's default, when unset)",
    "lr_scheduler": "train.lr_scheduler: cosine, linear, constant (constant_with_warmup); others refused",
    "cosine_min_lr_ratio": "train.min_lr_ratio",
    "warmup_steps": "train.warmup_steps, train.warmup_from_zero: true",
    "warmup_ratio": "train.warmup_ratio, train.warmup_from_zero: true (unset with warmup_steps: ratio 0.03, "
                    "at most 100 steps)",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "optimizer": "train.optimizer: adamw (torch, fused, paged 32-bit) or adamw_8bit (bitsandbytes 8-bit)",
    "adam_beta1": "train.adam_betas[0]",
    "adam_beta2": "train.adam_betas[1]",
    "adam_epsilon": "train.adam_eps",
    "train_on_inputs": "alpaca: datasets[].train_on_inputs; chat: roles_to_train: [system, user, assistant]; with "
                       "processor_type: datasets[].train_on_inputs (every token)",
    "unfrozen_parameters": "train.trainable_parameters (each pattern's dots made literal, as Axolotl does, and "
                           "matched from the start of the name, as Axolotl's re.match; a pattern with a row range "
                           "[start:end] refused)",
    "model_config": "model.config_overrides (each key checked against the model's config when it loads; "
                    "output_router_logits: true adds the MoE router's load-balancing loss, with SFT only, weighed "
                    "in a step as docs/models.md says: approximated with gradient_accumulation_steps > 1, where "
                    "Axolotl's weighs that many times more)",
    "overrides_of_model_config": "as model_config (its other name)",
    "dataset_exact_deduplication": "data.deduplicate: exact (datasets together, before val_set_size's split; "
                                   "test_datasets on their own). Axolotl compares the tokenized rows, finetune "
                                   "the rows as read (the same, but for rows made equal only by truncation); "
                                   "with rl: dpo or orpo and test_datasets approximated: Axolotl also drops the "
                                   "eval rows equal to training rows",
    "bf16": "model.dtype: bfloat16 (auto and unset too: bf16 on the GPUs Axolotl targets)",
    "bfloat16": "model.dtype: bfloat16",
    "fp16": "model.dtype: float16",
    "float16": "model.dtype: float16",
    "float32": "model.dtype: float32",
    "attn_implementation": "model.attn_implementation (exact kernels as auto)",
    "flash_attention": "model.attn_implementation: flash_attention_2",
    "sdp_attention": "model.attn_implementation: sdpa",
    "eager_attention": "model.attn_implementation: eager",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "trust_remote_code": "model.trust_remote_code",
    "type_of_model": "AutoModelForCausalLM and *ForCausalLM; with processor_type also *ForConditionalGeneration "
                     "and AutoModelForImageTextToText; other heads refused",
    "model_type": "as type_of_model (its alias)",
    "resize_token_embeddings_to_32x": "model.vocab_multiple_of: 32",
    "mean_resizing_embeddings": "model.mean_resizing (false when unset)",
    "tokenizer_type": "AutoTokenizer (or unset); another class only with --allow-approx",
    "tokenizer_use_fast": "true (or unset); false only with --allow-approx",
    "special_tokens": "tokenizer.special_tokens, tokenizer.added_special_tokens (a pad token alone is dropped)",
    "tokens": "tokenizer.added_tokens",
    "chat_template": "tokenizer.chat_template: a template shipped with finetune, Jinja text, or the tokenizer's own",
    "chat_template_jinja": "tokenizer.chat_template (the text, or the text of a file in the config's folder; "
                           "elsewhere with --allow-template-path)",
    "chat_template_kwargs": "tokenizer.chat_template_kwargs",
    "adapter": "adapter.type: lora, qlora (lora with load_in_4bit), none; qlora with processor_type: qlora "
               "with the vision side unquantized, approximated",
    "load_in_4bit": "adapter.type: qlora",
    "load_in_8bit": "refused (no 8-bit base); with --allow-approx: LoRA on the unquantized base",
    "lora_r": "adapter.r (8, PEFT's default, when unset)",
    "lora_alpha": "adapter.alpha (8, PEFT's default, when unset)",
    "peft_use_rslora": "adapter.use_rslora (scale alpha / sqrt(r))",
    "pretraining_dataset": "datasets (format: completion, text_column -> text_field) with data.streaming: true "
                           "(approximated: a text longer than sequence_len is truncated or dropped, not cut in pieces)",
    "streaming": "data.streaming: true (the datasets read as a stream, trained by max_steps)",
    **_each("streaming_multipack_buffer_size pretrain_multipack_buffer_size", "data.stream_buffer (with streaming)"),
    "early_stopping_patience": "eval.early_stopping_patience (approximated: final/ is the stopping step's weights, "
                               "not the best eval's)",
    "reward_model": "train.objective: reward (a sequence-classification head, the Bradley-Terry loss)",
    "num_labels": "1 with reward_model (one score); other counts refused",
    "center_rewards_coefficient": "reward.center_coefficient",
    "qat": "qat (each key as is; weight_dtype int8 and group_size 32 when unset, Axolotl's defaults)",
    "lora_dropout": "adapter.dropout",
    "lora_target_modules": "adapter.target_modules (a list of names, or a regular expression); with processor_type "
                           "a list becomes the expression PEFT matches (the vision modules too)",
    "lora_target_linear": "adapter.target_modules: all-linear (with processor_type approximated: the language "
                          "model's layers only, unless freeze_mm_modules)",
    "lora_modules_to_save": "adapter.modules_to_save",
    "lora_target_parameters": "adapter.target_parameters (LoRA on fused MoE expert weights, PEFT's target_parameters)",
    "bnb_config_kwargs": "finetune's NF4 with double quantization; other settings refused",
    "deepspeed": "distributed.strategy: ddp (ZeRO 1/2) or fsdp (ZeRO 3), distributed.cpu_offload",
    "fsdp": "distributed.strategy: fsdp (offload_params: distributed.cpu_offload)",
    "context_parallel_size": "distributed.context_parallel, context_parallel_method: ring (Axolotl's ring attention)",
    "sequence_parallel_degree": "distributed.context_parallel (the older name of context_parallel_size)",
    "fsdp_config": "distributed.strategy: fsdp, distributed.cpu_offload from offload_params",
    "eval_batch_size": "eval.micro_batch_size",
    "evals_per_epoch": "eval.every_epochs (1 / evals_per_epoch), or eval.every_steps with max_steps",
    "eval_steps": "eval.every_steps (a fraction: of the run's steps)",
    "eval_strategy": "epoch: eval.every_epochs: 1; no: no evaluation",
    "saves_per_epoch": "checkpoint.every_epochs (1 / saves_per_epoch), or checkpoint.every_steps with max_steps; "
                       "1 over 1 epoch is Axolotl's default (one save, at the epoch's end: finetune's final model, "
                       "or checkpoint.every_epochs: 1 with max_steps)",
    "save_steps": "checkpoint.every_steps (a fraction: of the run's steps)",
    "save_strategy": "epoch: checkpoint.every_epochs: 1; steps; no; best is refused",
    "save_total_limit": "checkpoint.keep_last (4 when unset)",
    "resume_from_checkpoint": "refused (an Axolotl checkpoint is no finetune checkpoint)",
    "auto_resume_from_checkpoints": "resume: auto",
    "logging_steps": "logging.every_steps",
    "use_tensorboard": "logging.tensorboard",
    "use_wandb": "logging.wandb",
    "wandb_project": "logging.wandb: true, logging.wandb_project",
    "use_mlflow": "logging.mlflow",
    "mlflow_experiment_name": "logging.mlflow_experiment",
    "plugins": "Liger, Cut Cross Entropy, kernels, expert parallel, SwanLab: dropped (speed, logging); the "
               "distillation plugin (KDPlugin) with kd_trainer; others refused",
    "kd_trainer": "with the distillation plugin: train.objective: distill, the teacher's top-k stored in the "
                  "datasets (distill.teacher_logprobs); approximated: Axolotl renormalizes each token's stored top-k "
                  "to sum to 1, finetune keeps the rest of the mass as one tail bucket (the same when they sum to 1)",
    "kd_alpha": "distill.sft_weight = kd_ce_alpha / kd_alpha: the loss is Axolotl's / kd_alpha, so "
                "train.max_grad_norm and train.adam_eps are divided by kd_alpha too (the same AdamW steps); 0 refused",
    "kd_ce_alpha": "distill.sft_weight = kd_ce_alpha / kd_alpha",
    "kd_temperature": "distill.temperature, when the KD datasets' generation temperature equals it (else refused: "
                      "Axolotl rescales the stored values to it, finetune takes them as the teacher at it)",
    "kd_beta": "distill.beta (the same convention: 0 the forward KL, teacher to student, 1 the reverse, between "
               "the generalized JSD; 0 written when unset); above 0 approximated: finetune's divergence counts the "
               "student's mass outside the teacher's top-k, Axolotl's sums over the top-k only",
    "kd_normalize_topk": "approximated: finetune's student is the whole vocabulary's distribution (its mass outside "
                         "the teacher's top-k one tail bucket); Axolotl renormalizes the student's top-k to sum to 1",
    "rl": "dpo, ipo: train.objective: dpo; orpo: train.objective: orpo; grpo: train.objective: grpo; others refused",
    "trl": "rl: grpo's grpo: section (beta, num_generations, max_completion_length, temperature, top_p, epsilon, "
           "epsilon_high, num_iterations, scale_rewards, loss_type dapo/grpo/dr_grpo -> normalize, "
           "mask_truncated_completions, reward_funcs, reward_weights); refused otherwise",
    "rl_beta": "dpo.beta or orpo.beta",
    "dpo_beta": "dpo.beta (rl_beta's old name)",
    "orpo_alpha": "orpo.beta",
    "dpo_label_smoothing": "dpo.label_smoothing",
    "dpo_loss_type": "dpo.loss (one of sigmoid, ipo, hinge)",
    "processor_type": "a vision-language model (AutoProcessor or a processor class; audio ones refused): chat "
                      "datasets with images, data.packing: false, data.max_seq_len: null, model.freeze_vision: false "
                      "without an adapter (docs/vision.md)",
    "processor_kwargs": "model.image_processor (the image processor's own settings: min_pixels, max_pixels, size, "
                        "...; other processor arguments refused)",
    "freeze_mm_modules": "the vision, audio and projector modules frozen as Axolotl names them: "
                         "train.trainable_parameters (full fine-tuning) or the adapter.target_modules expression; "
                         "nothing to do with a text model",
    "role_boundaries": "approximated: finetune finds each message from the chat template's rendering, not from "
                       "these markers (the same turns when they are the template's own)",
}

# Keys outside Axolotl's config schema that its own examples still set. Axolotl validates a config into its schema's
# pydantic model and keeps only the model's fields (validate_config's model_dump), so it ignores these whatever
# their value: dropping them trains what Axolotl trains. They are named here, not left to the unknown-key error,
# because they are stale options, not typos (a typo of a real key, adam_eps for adam_epsilon, stays an error).
_IGNORED = "not in Axolotl's config schema, so Axolotl ignores it"
OUTSIDE_SCHEMA: dict[str, str] = {
    "debug": f"{_IGNORED} (its --debug flag logs tokenized samples: nothing that is trained)",
    **_each("gptq_groupsize gptq_model_v1", f"{_IGNORED}: read only by Axolotl's first GPTQ loader, replaced in 2023 "
                                            "(a GPTQ base is `gptq` now, which is refused)"),
    "gptq_disable_exllama": f"{_IGNORED} (a GPTQ kernel switch: the same math; only with `gptq`, which is refused)",
    "sample_packing_seq_len_multiplier": f"{_IGNORED}: removed in 2023 with the multipack sampler that read it",
    "base_model_ignore_patterns": f"{_IGNORED}: removed in 2023 (it chose which files a hub download skipped)",
    "torch_dtype": f"{_IGNORED}: Axolotl sets it itself from bf16, fp16 and the like (model.dtype here)",
    "eta_min": f"{_IGNORED} (read nowhere; its cosine schedule's floor is cosine_min_lr_ratio)",
    "full_finetune": f"{_IGNORED} (read nowhere; no `adapter` is full fine-tuning)",
    "test_value": f"{_IGNORED} (read nowhere)",
}

DROPPED: dict[str, str] = {
    **_each("tf32 torch_compile torch_compile_backend torch_compile_mode torch_compile_options flash_optimum "
            "flash_attn_cross_entropy flash_attn_fuse_mlp flash_attn_d512 flex_attention flex_attn_compile_kwargs "
            "fused_attn_kernel gemma4_hybrid_attn_impl large_head_attention sdpa_varlen heads_k_stride "
            "ring_attn_func batch_flattening use_kernels use_scattermoe use_sonicmoe experts_implementation "
            "expert_backend moe_bnb_fast moe_dequant_chunk_size moe_grouped_backend use_dsv4_kernels "
            "use_glm_dsa_kernels dsv4_fp4_grouped_mode dsv4_bf16_all dsv4_shared_mlp_lora_kernel nvfp4_merge_aware "
            "nvfp4_merge_aware_start_step lora_mlp_kernel lora_qkv_kernel lora_o_kernel lora_embedding_kernel "
            "deepcompile liger_rms_norm liger_rms_norm_gated liger_glu_activation liger_swiglu liger_layer_norm "
            "liger_rope liger_cross_entropy liger_fused_linear_cross_entropy cut_cross_entropy "
            "chunked_cross_entropy chunked_cross_entropy_num_chunks dpo_use_liger_kernel dpo_padding_free "
            "dpo_use_logits_to_keep multipack_real_batches sample_packing_bin_size sample_packing_group_size "
            "sample_packing_mp_start_method dense_mixer xformers_attention", SPEED),
    **_each("activation_offloading layer_offloading gradient_checkpointing_kwargs selective_checkpointing "
            "tiled_mlp tiled_mlp_num_shards tiled_mlp_use_original_mlp embeddings_skip_upcast gc_steps "
            "gc_collect_steps torch_empty_cache_steps gpu_memory_limit max_memory fp32_norms fp32_norm_classes "
            "qlora_sharded_model_loading lora_on_cpu accelerator_config", MEMORY),
    **_each("tensor_parallel_size dp_shard_size dp_replicate_size "
            "expert_parallel_size expert_parallel_backend expert_parallel_num_nvl_bytes "
            "expert_parallel_num_rdma_bytes expert_parallel_fallback_on_unsupported fsdp_version "
            "fsdp_final_state_dict_type ddp ddp_find_unused_parameters ddp_broadcast_buffers ddp_bucket_cap_mb "
            "ddp_timeout", LAYOUT),
    **_each("wandb_name wandb_entity wandb_watch wandb_log_model wandb_run_id wandb_mode mlflow_run_name "
            "mlflow_tracking_uri hf_mlflow_log_artifacts use_comet comet_api_key comet_workspace comet_project_name "
            "comet_experiment_key comet_mode comet_online comet_experiment_config use_trackio trackio_project_name "
            "trackio_run_name trackio_space_id use_swanlab swanlab_project swanlab_experiment_name "
            "swanlab_description swanlab_mode swanlab_workspace swanlab_api_key swanlab_web_host swanlab_api_host "
            "swanlab_log_model swanlab_lark_webhook_url swanlab_lark_secret swanlab_log_completions "
            "swanlab_completion_log_interval swanlab_completion_max_buffer use_otel_metrics otel_metrics_host "
            "otel_metrics_port include_tkps include_tokens_per_second", TRACKER),
    **_each("generate_samples num_generation_samples generation_max_new_tokens generation_temperature "
            "generation_top_k generation_top_p generation_do_sample generation_prompt_ratio do_causal_lm_eval "
            "eval_causal_lm_metrics eval_max_new_tokens eval_table_size do_bench_eval bench_dataset bench_split "
            "profiler_steps profiler_steps_start gradio_title gradio_share gradio_server_name gradio_server_port "
            "gradio_max_new_tokens gradio_temperature dpo_generate_during_eval loss_watchdog_threshold "
            "loss_watchdog_patience", MONITOR),
    **_each("hub_model_id hub_revision hub_strategy push_dataset_to_hub dataset_prepared_path "
            "num_dataset_shards_to_save save_safetensors save_only_model save_first_step dynamic_checkpoint "
            "tokenizer_save_jinja_files merge_lora merge_method quantization hf_use_auth_token", HUB),
    **_each("capabilities env_capabilities axolotl_config_path is_preprocess is_falcon_derived_model "
            "is_llama_derived_model is_mistral_derived_model is_qwen_derived_model total_num_tokens "
            "total_supervised_tokens local_rank world_size strict device use_ray ray_num_workers ray_run_name "
            "resources_per_worker", INTERNAL),
    **_each("device_map low_cpu_mem_usage experimental_skip_move_to_device cls_model_config", LOADING),
    **_each("dataset_num_proc dataset_processes dataset_keep_in_memory preprocess_iterable skip_prepare_dataset "
            "remove_unused_columns dataloader_num_workers dataloader_pin_memory dataloader_prefetch_factor "
            "pad_to_sequence_len pad_to_multiple_of eval_sample_packing",
            "how data is prepared or batched: the same samples and the same loss"),
    "shuffle_merged_datasets": "finetune shuffles the rows every epoch, seeded",
    "shuffle_before_merging_datasets": "finetune shuffles the rows every epoch, seeded",
    "evaluation_strategy": "deprecated in Axolotl, which ignores it",
    "eval_sequence_len": "the eval data's length only: nothing that is trained",
    "precompute_ref_log_probs": "finetune always computes the DPO reference once before training (the same math)",
    "eot_tokens": "finetune trains each trained turn through the end-of-turn marker its template writes",
    "peft_ensure_weight_tying": "finetune keeps tied embeddings tied when it trains them",
    "torchdistx_path": _unless("optimizer adamw_anyprecision"),
    "lr_div_factor": _unless("lr_scheduler one_cycle"),
    **_each("adam_beta3 adam_epsilon2", _unless("optimizer came_pytorch")),
    **_each("dion_lr dion_momentum dion_rank_fraction dion_rank_multiple_of", _unless("optimizer dion")),
    **_each("qgalore_rank qgalore_update_proj_gap qgalore_scale qgalore_proj_type qgalore_proj_quant "
            "qgalore_proj_bits qgalore_proj_group_size qgalore_cos_threshold qgalore_gamma_proj qgalore_queue_size",
            _unless("the Q-GaLore optimizer")),
    "loraplus_lr_embedding": _unless("loraplus_lr_ratio"),
    **_each("relora_prune_method relora_prune_ratio relora_cpu_offload", _unless("relora")),
    **_each("pose_max_context_len pose_num_chunks pose_split_on_token_ids", _unless("use_pose")),
    **_each("scaling_softmax_factor scaling_softmax_bias", _unless("scaling_softmax")),
    **_each("kto_desirable_weight kto_undesirable_weight", _unless("rl: kto")),
    **_each("simpo_gamma cpo_alpha", _unless("rl: simpo")),
    **_each("max_prompt_len vllm", _unless("rl: grpo and other online RL")),
    "pretrain_multipack_attn": "packed documents never attend to each other in finetune (always on)",
    "pretraining_sample_concatenation": "finetune packs streamed documents whole, each isolated (data.packing)",
    **_each("metric_for_best_model greater_is_better", _unless("load_best_model_at_end or save_strategy: best")),
    **_each("grokfast_alpha grokfast_lamb", _plugin("Grokfast")),
    **_each("kd_online_server kd_online_timeout kd_online_topk", _unless("kd_online_server_base_url")),
    "kd_temperature_min": _unless("kd_online_server_base_url") + " (it anneals the online teacher's temperature)",
    **_each("lm_eval_model lm_eval_tasks lm_eval_batch_size lm_eval_post_train", _plugin("lm-eval")),
    **_each("spectrum_top_fraction spectrum_model_name", _plugin("Spectrum")),
    "mora": _plugin("MoRA"),
    "hatchery": _plugin("Hatchery"),
    **_each("nemo_gym_enabled nemo_gym_dir nemo_gym_auto_clone nemo_gym_config_paths nemo_gym_datasets "
            "nemo_gym_auto_start nemo_gym_head_port nemo_gym_server_timeout nemo_gym_verify_timeout "
            "nemo_gym_run_timeout nemo_gym_max_turns nemo_gym_model_name nemo_gym_multi_turn", _plugin("NeMo Gym")),
    **OUTSIDE_SCHEMA,
}

# Key -> what the recipe does instead (carried over only with --allow-approx).
APPROXIMATED: dict[str, str] = {
    "min_sample_len": "finetune keeps samples of any length (Axolotl drops those shorter than this, 2 by default)",
    "sample_packing_eff_est": "finetune counts its steps exactly; Axolotl's estimate set the schedule's length",
    "sample_packing_sequentially": "finetune packs best-fit decreasing, not in dataset order",
    "quantize_moe_experts": "the MoE expert weights stay unquantized (more memory, the unrounded weights)",
    "model_quantization_config": "the model loads as transformers loads it by default (e.g. MXFP4 dequantized)",
    "model_quantization_config_kwargs": "the model loads as transformers loads it by default",
    "expert_parallel_token_capacity": "no token is dropped by an expert capacity limit",
    "tokenizer_legacy": "the tokenizer keeps the legacy setting its own files give",
    "dataloader_drop_last": "data.drop_last: true drops an epoch's incomplete last optimizer step, not micro-batch",
    "peft_autocast_adapter_dtype": "the adapter's weights are float32 (PEFT's default)",
    "sage_attention": "attention is exact (SageAttention quantizes it)",
    **_each("image_size image_resize_algorithm", "an image reaches the model's image processor at its own size "
            "(Axolotl first resizes an `images`/`image` column's images to image_size, padding to a square)"),
}

REFUSED: dict[str, str] = {
    "process_reward_model": "process reward models are not supported",
    "reinit_weights": "random weights come from model.config, not from a model.path: write the model's config "
                      "(its config.json) under model.config with model.init: random, and no model.path",
    "llama4_linearized_experts": "Llama 4 with linearized experts is not supported (Llama 4 is multimodal here)",
    **_each("dataset_shard_num dataset_shard_idx", "training on one shard of the data is not supported; cut the "
                                                   "data file instead"),
    "gptq": "GPTQ-quantized base models are not supported; use the unquantized model (qlora for 4-bit)",
    **_each("fp8 fp8_enable_fsdp_float8_all_gather", "FP8 training is not supported"),
    **_each("gemma4_fp8_nonexpert gemma4_nf4_nonexpert nonexpert_quantization dsv4_fp8_nonexpert_mode "
            "dsv4_fp8_lora_kernel", "quantizing the non-expert weights is not supported"),
    "use_onebitllms": "1.58-bit (onebitllms) training is not supported",
    "diffusion": "diffusion language-model training is not supported",
    "ebft": "energy-based fine-tuning (EBFT) is not supported",
    "llmcompressor": "llm-compressor sparse fine-tuning is not supported",
    **_each("use_eaft eaft_alpha eaft_k", "the entropy-aware focal loss (EAFT) is not supported"),
    **_each("lisa_n_layers lisa_step_interval lisa_layers_attribute", "LISA (layer sampling) is not supported"),
    "relora": "ReLoRA is not supported",
    **_each("jagged_restart_steps jagged_restart_warmup_steps jagged_restart_anneal_steps",
            "jagged learning-rate restarts are not supported"),
    "cosine_constant_lr_ratio": "a cosine schedule held constant part-way is not supported (lr_scheduler: "
                                "cosine, linear or constant)",
    "lr_quadratic_warmup": "a quadratic warmup is not supported (finetune's warmup is linear)",
    "lr_scheduler_kwargs": "scheduler arguments are not supported (train.lr_scheduler, min_lr_ratio)",
    "lr_groups": "learning rates per parameter group are not supported",
    **_each("embedding_lr embedding_lr_scale", "a separate embedding learning rate is not supported"),
    "loraplus_lr_ratio": "LoRA+ (separate learning rates for A and B) is not supported",
    **_each("optim_args optim_target_modules", "optimizer arguments and GaLore targets are not supported"),
    "load_best_model_at_end": "finetune's final model is the last step's; keeping the best checkpoint is not "
                              "supported",
    "neftune_noise_alpha": "NEFTune embedding noise is not supported",
    "noisy_embedding_alpha": "NEFTune embedding noise (noisy_embedding_alpha) is not supported",
    "use_pose": "PoSE position skipping is not supported",
    "scaling_softmax": "scaled softmax (SSMax) attention is not supported",
    "s2_attention": "S2 (shifted sparse) attention is not supported",
    "rope_scaling": "removed from Axolotl; RoPE scaling belongs to the model's config",
    "max_packed_sequence_len": "removed from Axolotl (Axolotl itself rejects it); use sample_packing",
    "flash_attn_rms_norm": "removed from Axolotl (Axolotl itself rejects it)",
    "auto_find_batch_size": "finetune never changes the batch behind your back; set micro_batch_size",
    "trainer_cls": "a custom trainer class is not supported",
    **_each("overrides_of_model_kwargs model_kwargs", "extra from_pretrained arguments are not supported"),
    **_each("revision_of_model model_revision", "a hub revision is not supported: download it "
                                                "(huggingface-cli download MODEL --revision REV) and use the directory"),
    "base_model_config": "a separate model config is not supported; use a model directory with its config.json",
    "added_tokens_overrides": "renaming reserved tokens is not supported; add new tokens with `tokens`",
    "fix_untrained_tokens": "editing embedding rows before training is not supported",
    "shrink_embeddings": "shrinking the embedding below its rows is not supported",
    "default_system_message": "a default system message is not supported; put it in the data",
    "lora_fan_in_fan_out": "Conv1D (fan-in/fan-out) LoRA layers are not supported",
    **_each("lora_rank_pattern lora_alpha_pattern", "per-module LoRA ranks or alphas are not supported"),
    **_each("peft_use_dora", "DoRA is not supported"),
    "peft_init_lora_weights": "other LoRA initializations than PEFT's default are not supported",
    **_each("peft_layers_to_transform peft_layers_pattern peft_layer_replication",
            "LoRA on some layers only, or replicated layers, is not supported"),
    "peft_trainable_token_indices": "training some embedding rows only is not supported (use modules_to_save)",
    "peft": "LoftQ initialization is not supported",
    "lora_model_dir": "starting from a trained adapter is not supported",
    "liger_use_token_scaling": "Liger's token-scaled cross-entropy changes the loss; not supported",
    **_each("dpo_loss_weights dpo_use_weighting", "weighted or mixed DPO losses are not supported"),
    "dpo_norm_loss": "a length-normalized DPO loss is not supported (dpo.loss: ipo is length-averaged)",
    "rpo_alpha": "the RPO term (DPO plus NLL) is not supported",
    "kd_online_server_base_url": "a teacher served over HTTP (vLLM, SGLang) is not supported; finetune's online "
                                 "teacher is a model it loads itself (distill.teacher: PATH, docs/distill.md), or "
                                 "store the teacher's top-k in the datasets",
}

DATASET_MAPPED: dict[str, str] = {
    "path": "path",
    "drop_system_message": "drop_system_message (chat_template datasets)",
    "data_files": "data_files (a list: files of the hub dataset)",
    "split": "split",
    "name": "name",
    "type": "format (alpaca[:style]: alpaca with prompt_template; chat_template: chat; completion; "
            "chat_template.default with rl: preference; axolotl.integrations.kd.chat_template[.load_legacy] with "
            "kd_trainer: chat, the teacher in the rows)",
    "field_messages": "messages_field (preference: prompt_field)",
    "message_property_mappings": "role_field, content_field",
    "message_field_role": "role_field",
    "message_field_content": "content_field",
    "roles": "role_map (Axolotl's default human -> user, gpt -> assistant written out)",
    "roles_to_train": "roles_to_train",
    "train_on_eos": "turn (the default): each trained turn's end-of-turn marker, as finetune always trains it",
    "train_on_eot": "as train_on_eos",
    "field": "text_field",
    "field_chosen": "chosen_field",
    "field_rejected": "rejected_field",
    "chat_template": "tokenizer.chat_template (every dataset must agree)",
    "chat_template_jinja": "tokenizer.chat_template",
    "message_field_training": "train (the per-message flag finetune reads)",
    "field_thinking": "reasoning_content or thinking (the fields finetune reads)",
    "template_thinking_key": "reasoning_content or thinking",
    "logprobs_field": "distill.teacher_logprobs (distillation types; \"logprobs\" when unset; every dataset the same)",
    "temperature": "distillation types: the generation temperature, which must be kd_temperature (1 when unset)",
}

DATASET_DROPPED: dict[str, str] = {
    "ds_type": "finetune reads a file by its suffix",
    "input_format": "finetune reads a file by its suffix",
    "preprocess_shards": "how data is prepared: the same samples",
    **_each("step_separator max_completion_length train_on_last_step_only", _unless("process_reward_model")),
}

DATASET_REFUSED: dict[str, str] = {
    "revision": "a dataset revision is not supported; download it and give the file as path",
    "trust_remote_code": "datasets with loading code are not supported",
    **_each("shards shards_idx", "training on one shard of a dataset is not supported; cut the file instead"),
    "input_transform": "row transforms are not supported; transform the data first",
    "conversation": "fastchat conversation templates are not supported; use type: chat_template",
    **_each("field_human field_model", "these legacy field names are not supported; use type: chat_template"),
    "field_tools": "tool definitions passed to the chat template are not supported",
    "message_field_training_detail": "training parts of a message is not supported (per-message train flags are)",
    "split_thinking": "splitting the reasoning out of the content is not supported; give reasoning_content",
}

# Axolotl's chat template names -> the template finetune ships that renders training conversations the same
# (checked by rendering both on the same conversations); None: finetune ships none, so the recipe keeps the
# tokenizer's own template (an approximation when a dataset renders with it).
CHAT_TEMPLATES: dict[str, str | None] = {
    "chatml": "chatml", "llama3": "llama3", "qwen_25": "qwen2_5", "qwen3": "qwen3", "qwen3_5": "qwen3_5",
    "gemma": "gemma", "gemma3": "gemma3", "gemma3n": "gemma3", "gemma4": "gemma4", "gemma4_unified": "gemma4",
    "qwen2_vl": "qwen2_vl",
    **dict.fromkeys(("alpaca", "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken", "cohere",
                     "llama3_2_vision", "llama4", "phi_3", "phi_35", "phi_4", "deepseek_v2", "deepseek_v3", "jamba",
                     "falcon_h1", "nemotron_h", "exaone", "exaone4", "metharme", "pixtral", "llava",
                     "command_a", "command_a_tool_use", "command_a_rag", "aya")),
}
