"""Faults and bad input that the owners' tests already cover, by pytest node id (a parametrised test
counts each case). `make test-faults` runs them with the fault suite and the report counts them; the
fault suite itself covers only what they do not."""

from __future__ import annotations

OWNER_TESTS: dict[str, list[str]] = {
    "crash/SIGKILL of prepare_data (fixed points)": [
        "tests/data/test_prepare.py::test_rerun_after_a_crash_at_any_point_is_byte_identical",
        "tests/data/test_prepare.py::test_rerun_after_sigkill_is_byte_identical",
        "tests/data/test_prepare.py::test_whole_files_resume_after_a_crash_in_either_mode",
        "tests/data/test_prepare.py::test_a_resume_with_a_validation_split_tokenizes_only_what_is_not_kept",
        "tests/data/test_prepare_chat.py::test_rerun_after_sigkill_is_byte_identical",
        "tests/data/test_prepare_chat.py::test_resume_after_a_crash_is_byte_identical",
    ],
    "bad input: corrupt shard (flipped byte, no EOS, offsets)": [
        "tests/data/test_validate.py::test_flipped_byte_and_missing_eos",
        "tests/data/test_validate.py::test_bad_offsets",
        "tests/data/test_validate.py::test_corrupt_val_split",
        "tests/data/test_loader.py::test_document_index_that_does_not_span_its_shard_is_named",
    ],
    "bad input: damaged loss mask (missing, short, flipped, not 0/1, trained padding; validate, register, merge)": [
        "tests/data/test_validate_masks.py::test_a_damaged_mask_fails_naming_its_shard",
        "tests/data/test_validate_masks.py::test_a_trained_padding_token_fails",
        "tests/data/test_validate_masks.py::test_trained_counts_must_agree_with_the_manifest",
        "tests/data/test_olmocore_interop.py::test_a_missing_extra_or_wrong_mask_is_refused_naming_it",
        "tests/data/test_prepare_chat.py::test_partitions_merge_into_the_single_run_masks_included",
    ],
    "bad input: malformed conversations (prepare --format chat)": [
        "tests/data/test_prepare_chat.py::test_every_bad_record_is_reported_as_expected",
        "tests/data/test_prepare_chat.py::test_strict_stops_at_the_first_bad_conversation_naming_file_line_and_reason",
        "tests/data/test_prepare_chat.py::test_contradictory_or_missing_flags_are_refused_by_name",
    ],
    "bad input: truncated shard": [
        "tests/data/test_validate.py::test_truncated_bin",
        "tests/data/test_loader.py::test_truncated_bin_is_named",
        "tests/data/test_shards.py::test_truncated_shard_is_refused",
    ],
    "bad input: out-of-range token id": [
        "tests/data/test_validate.py::test_out_of_range_id",
        "tests/data/test_loader.py::test_an_id_beyond_the_tokenizer_is_named",
    ],
    "bad input: token id beyond the vocabulary in a shard, metadata not updated": [
        "tests/data/test_loader.py::test_an_id_beyond_the_vocabulary_inside_a_shard_stops_at_its_batch_naming_the_shard",
        "tests/data/test_loader.py::test_an_id_beyond_the_vocabulary_in_a_validation_source_is_named",
        "tests/data/test_loader.py::test_an_id_beyond_the_vocabulary_ends_a_training_run_with_one_line_before_its_step",
    ],
    "2,000 shard files under ulimit -n 256 (train, eval, validate)": [
        "tests/data/test_loader.py::test_2000_shard_files_train_validate_and_check_under_ulimit_256",
    ],
    "bad input: manifest disagrees with shards (validate)": [
        "tests/data/test_validate.py::test_manifest_shard_mismatch",
        "tests/data/test_validate.py::test_missing_shard_and_unlisted_shard",
        "tests/data/test_loader.py::test_missing_shard_is_named",
    ],
    "bad input: two tokenizers in one source": [
        "tests/data/test_loader.py::test_mixed_dtypes_and_tokenizers_in_one_source_are_refused",
        "tests/data/test_loader.py::test_sources_of_different_tokenizers_are_refused",
        "tests/data/test_validate.py::test_wrong_tokenizer",
        "tests/data/test_prepare.py::test_output_of_another_tokenizer_or_settings_is_refused",
    ],
    "bad input: raw records and input paths (prepare)": [
        "tests/data/test_prepare.py::test_every_bad_record_kind_is_skipped_counted_and_located",
        "tests/data/test_prepare.py::test_clear_errors_before_any_work",
        "tests/data/test_prepare.py::test_inputs_without_documents_are_an_error_and_leave_no_source",
        "tests/data/test_validate.py::test_a_source_of_no_tokens_fails",
    ],
    "bad input: truncated or damaged compressed input": [
        "tests/data/test_readers.py::test_a_damaged_compressed_file_is_an_error_naming_it",
        "tests/data/test_prepare.py::test_a_truncated_compressed_input_stops_the_run_naming_it_and_keeps_complete_shards",
        "tests/data/test_readers.py::test_a_truncated_compressed_file_names_its_last_whole_line",
    ],
    "bad input: YAML typo'd key / wrong type": [
        "tests/train/test_config.py::test_config_errors_name_the_key",
        "tests/train/test_config.py::test_missing_file_is_named",
    ],
    "bad input: ds config contradicts train config": [
        "tests/train/test_ds_config.py::test_concrete_value_that_agrees_is_kept_and_one_that_disagrees_names_both",
        "tests/train/test_ds_config.py::test_structural_errors",
    ],
    "a second start or resume beside a live run": [
        "tests/train/test_run_lock.py::test_a_held_run_dir_is_refused_naming_the_holder_and_freed_by_its_death",
        "tests/train/test_run_lock.py::test_second_start_beside_a_live_run_is_refused_and_a_restart_after_sigkill_logs_each_step_once",
    ],
    "non-finite loss or gradient: never saved, run stops naming causes": [
        "tests/train/test_nonfinite.py::test_a_loss_nan_from_the_first_step_saves_nothing_and_names_the_config_value",
        "tests/train/test_nonfinite.py::test_a_run_that_diverges_keeps_its_last_finite_checkpoint_newest",
    ],
    "bad input: model/vocab/batch cross-checks": [
        "tests/train/test_preflight.py::test_vocab_and_tokenizer_checks",
        "tests/train/test_preflight.py::test_shape_batch_and_deepspeed_checks",
        "tests/train/test_preflight.py::test_resume_refuses_another_model_or_world_size",
    ],
    "bad input: interrupted checkpoint save on disk": [
        "tests/checkpoint/test_checkpoint.py::test_resume_auto_takes_the_newest_complete_checkpoint",
        "tests/checkpoint/test_checkpoint.py::test_retention_keeps_last_n_and_every_mth_and_clears_old_partials",
    ],
    "background save: in flight never latest/resumed/pruned/evaluated; failure raised": [
        "tests/checkpoint/test_async_save.py::test_a_save_in_flight_is_not_latest_resumed_or_pruned_until_every_rank_wrote",
        "tests/checkpoint/test_async_save.py::test_a_failed_background_write_leaves_the_previous_checkpoint_and_is_raised_at_the_next_save",
        "tests/train/test_run_dir.py::test_background_and_blocking_saves_write_the_same_checkpoints",
    ],
    "bad input: malformed eval task records": [
        "tests/eval/test_tasks.py::test_plain_jsonl_errors_name_file_and_line",
        "tests/eval/test_tasks.py::test_olmes_errors",
    ],
    "verifier hangs (scored 0 with its reason, worker replaced, nothing left running)": [
        "tests/eval/test_scorer.py::test_a_hanging_verifier_times_out_and_the_batch_goes_on",
        "tests/eval/test_scorer.py::test_a_code_run_past_the_limit_is_killed_with_everything_it_started",
        "tests/eval/test_code_verifier.py::test_an_infinite_loop_times_out_per_test",
        "tests/eval/test_code_verifier.py::test_a_hang_in_c_code_and_a_sleep_are_killed",
        "tests/eval/test_code_verifier.py::test_forks_are_bounded_and_killed_with_the_test",
    ],
    "verifier raises or crashes (scored 0 with its reason, the batch goes on)": [
        "tests/eval/test_scorer.py::test_crashes_and_memory_are_reasons_not_failures_of_the_run",
        "tests/eval/test_verifiers.py::test_a_failing_verifier_gives_zero_and_the_reason",
        "tests/eval/test_code_verifier.py::test_crashes_and_exits_fail_the_test_and_cannot_fake_a_pass",
        "tests/eval/test_code_verifier.py::test_no_network_and_no_other_programs",
    ],
    "verifier eats memory (out of memory, worker replaced)": [
        "tests/eval/test_scorer.py::test_crashes_and_memory_are_reasons_not_failures_of_the_run",
        "tests/eval/test_code_verifier.py::test_a_memory_hog_is_stopped_at_its_limit",
    ],
}


if __name__ == "__main__":  # the node ids, for `make test-faults` to run with the fault suite
    print(" ".join(sorted({n for ids in OWNER_TESTS.values() for n in ids})))
