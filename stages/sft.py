def run(cfg):
    print(cfg.stage, cfg.train.lr)
