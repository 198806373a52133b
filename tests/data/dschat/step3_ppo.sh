#!/bin/bash
# A DeepSpeed-Chat-shaped step-3 (PPO) launch script, written for rlhf's tests, in the form of
# DeepSpeed-Chat's training/step3_rlhf_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh.
ACTOR_MODEL_PATH=$1
CRITIC_MODEL_PATH=$2
DATA=$3
ACTOR_ZERO_STAGE=$4
CRITIC_ZERO_STAGE=$5
OUTPUT=$6
if [ "$OUTPUT" == "" ]; then
    OUTPUT=./output/step3
fi
if [ "$ACTOR_ZERO_STAGE" == "" ]; then
    ACTOR_ZERO_STAGE=3
fi
if [ "$CRITIC_ZERO_STAGE" == "" ]; then
    CRITIC_ZERO_STAGE=3
fi
mkdir -p $OUTPUT

Num_Padding_at_Beginning=1 # this is model related

Actor_Lr=9.65e-6
Critic_Lr=5e-6

deepspeed --num_gpus 1 --master_port 12346 training/step3_rlhf_finetuning/main.py \
   --data_path $DATA \
   --data_split 2,4,4 \
   --actor_model_name_or_path $ACTOR_MODEL_PATH \
   --critic_model_name_or_path $CRITIC_MODEL_PATH \
   --num_padding_at_beginning $Num_Padding_at_Beginning \
   --per_device_generation_batch_size 4 \
   --per_device_training_batch_size 2 \
   --generation_batches 1 \
   --ppo_epochs 1 \
   --max_answer_seq_len 32 \
   --max_prompt_seq_len 192 \
   --actor_learning_rate ${Actor_Lr} \
   --critic_learning_rate ${Critic_Lr} \
   --actor_weight_decay 0.1 \
   --critic_weight_decay 0.1 \
   --num_train_epochs 1 \
   --lr_scheduler_type cosine \
   --gradient_accumulation_steps 1 \
   --actor_dropout 0.0 \
   --num_warmup_steps 100 \
   --deepspeed --seed 1234 \
   --dtype fp16 \
   --enable_hybrid_engine \
   --inference_tp_size 1 \
   --tp_gather_partition_size 4 \
   --actor_zero_stage $ACTOR_ZERO_STAGE \
   --critic_zero_stage $CRITIC_ZERO_STAGE \
   --enable_ema \
   --print_answers \
   --align_overflow \
   --output_dir $OUTPUT \
    &> $OUTPUT/training.log
