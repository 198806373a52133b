"""The RL loop's parts between the engine and the recipe: experience (generate → score →
advantages), the PPO update over minibatches and micro-batches, the EMA actor. ``stages/ppo.py``
composes them."""
