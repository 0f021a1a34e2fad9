"""What the compile-only tests of both tracks share about ptxas's report (a helper module: pytest
collects no tests here)."""


def ptxas_ran(resources, arch):
    """Whether ptxas assembled the PTX for `arch` ("sm_90a", "sm_100a"), so that its registers and
    spills can be checked: common.tools.ptx.ptxas_resources's result (a compile report's
    .resources). False where ptxas is not installed (None), is older than the PTX ISA the DSL
    writes (ptxas_too_old) or does not know `arch` (a CUDA 12.x ptxas facing sm_100a): the checks
    on its report are left out there, a limit of the toolkit, not of the kernel. Any other failure
    of ptxas - PTX it rejects - fails the test instead of passing the checks unseen."""
    if resources is None or resources.get("ptxas_too_old"):
        return False
    if "error" in resources:
        from common.tools.notebook import ptxas_info

        info = ptxas_info()
        if info is not None and info["targets"] and arch not in info["targets"]:
            return False
        raise AssertionError(f"ptxas rejected the PTX for {arch}: {resources['error']}")
    assert "registers" in resources and "spill_stores" in resources, resources
    return True
