#!/bin/bash
# A DeepSpeed-Chat-shaped step-1 launch script, written for rlhf's tests (tests/unit/migrate/test_migrate.py,
# tests/e2e/test_migrate.py) in the form of DeepSpeed-Chat's training/step1_supervised_finetuning/
# training_scripts/*/run_*.sh: positional arguments with defaults, then one deepspeed launch.
MODEL=$1
DATA=$2
OUTPUT=$3
ZERO_STAGE=$4
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output/actor
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=2
fi
mkdir -p $OUTPUT

deepspeed --num_gpus 1 training/step1_supervised_finetuning/main.py \
   --data_path $DATA \
   --data_split 2,4,4 \
   --model_name_or_path $MODEL \
   --per_device_train_batch_size 4 \
   --per_device_eval_batch_size 4 \
   --max_seq_len 256 \
   --learning_rate 9.65e-6 \
   --weight_decay 0. \
   --num_train_epochs 1 \
   --gradient_accumulation_steps 2 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --gradient_checkpointing \
   --dtype bf16 \
   --zero_stage $ZERO_STAGE \
   --deepspeed \
   --print_loss \
   --add_eot_token \
   --enable_tensorboard \
   --tensorboard_path $OUTPUT \
   --output_dir $OUTPUT \
   &> $OUTPUT/training.log
