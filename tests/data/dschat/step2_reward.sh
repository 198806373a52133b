#!/bin/bash
# A DeepSpeed-Chat-shaped step-2 (reward model) launch script, written for rlhf's tests, in the form of
# DeepSpeed-Chat's training/step2_reward_model_finetuning/training_scripts/opt/single_gpu/run_350m.sh.
MODEL=$1
DATA=$2
OUTPUT=$3
ZERO_STAGE=$4
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output/reward
fi
if [ "$ZERO_STAGE" == "" ]; then
    ZERO_STAGE=0
fi
mkdir -p $OUTPUT

deepspeed --num_gpus 1 training/step2_reward_model_finetuning/main.py \
   --data_path $DATA \
   --data_split 2,4,4 \
   --model_name_or_path $MODEL \
   --num_padding_at_beginning 1 \
   --per_device_train_batch_size 4 \
   --per_device_eval_batch_size 4 \
   --max_seq_len 256 \
   --learning_rate 5e-5 \
   --weight_decay 0.1 \
   --num_train_epochs 1 \
   --dropout 0.0 \
   --gradient_accumulation_steps 1 \
   --lr_scheduler_type cosine \
   --num_warmup_steps 0 \
   --seed 1234 \
   --zero_stage $ZERO_STAGE \
   --deepspeed \
   --eval_interval 10 \
   --eval_iters 20 \
   --output_dir $OUTPUT \
   &> $OUTPUT/training.log
