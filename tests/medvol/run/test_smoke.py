from medvol.run.training import run


def test_vqgan_trains_one_epoch(tiny_cfg, tmp_path):
    metrics = run(tiny_cfg())
    assert "val/psnr" in metrics
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "split.json").is_file()
