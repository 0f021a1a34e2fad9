# device run: smoke, tests, timing
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.:$PYTHONPATH
timeout 50 python3 .scratch_attn/smoke.py 2>&1 | grep -v Deprecat | tee $OUT/smoke.log
grep -q "TIMEOUT" $OUT/smoke.log && { echo "smoke TIMEOUT: stopping"; exit 3; }
timeout 140 python3 -m pytest -q -p no:cacheprovider tests/test_stage2_hopper.py tests/test_stage3_hopper.py tests/test_stage4_hopper.py tests/test_stage5_hopper.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head -30
timeout 90 python3 .scratch_attn/timing.py 2>&1 | grep -v Deprecat | tee $OUT/timing.log
