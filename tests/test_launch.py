from dmltrain import launch


def test_single_process_defaults():
    info = launch.single_process(env={})
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (0, 1, 0, "single")
    assert info.is_main and not info.distributed
    assert info.job_id is None


def test_job_id_from_batch_systems():
    assert launch.job_id({"SLURM_JOB_ID": "123"}) == "123"
    assert (
        launch.job_id(
            {"SLURM_JOB_ID": "124", "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "4"}
        )
        == "120_4"
    )
    assert launch.job_id({"PBS_JOBID": "987.desched1"}) == "987"
    assert launch.job_id({}) is None
