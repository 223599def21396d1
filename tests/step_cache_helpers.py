"""diffusers' First Block Cache as the step-cache tests and bench/step_cache_gpu.py take it for the reference
(FirstBlockCacheRecorder): the hook with its tail arithmetic mended per stream (huggingface/diffusers#14280, as the
open fix #14359 does), each decision recorded per cache context."""

import torch


class FirstBlockCacheRecorder:
    """diffusers' FBC applied to a transformer, with the tail mended and each decision recorded per context."""

    def __init__(self, monkeypatch, transformer, threshold):
        from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
        from diffusers.hooks import first_block_cache as fbc
        from diffusers.hooks.hooks import HookRegistry

        self.skipped = {}
        recorder = self

        class MendedTail(fbc.FBCBlockHook):
            def new_forward(self, module, *args, **kwargs):
                state = self.state_manager.get_state()
                if not state.should_compute:
                    return super().new_forward(module, *args, **kwargs)
                output = self.fn_ref.original_forward(*args, **kwargs)
                head_img, head_txt = state.head_block_output
                if isinstance(output, torch.Tensor):          # FLUX.2's single block: the joined [text; image]
                    n_txt = head_txt.shape[1]
                    res = (output[:, n_txt:] - head_img, output[:, :n_txt] - head_txt)
                else:                                         # SD3.5's last block: (None, image)
                    res = (output[self._metadata.return_hidden_states_index] - head_img, torch.zeros_like(head_txt))
                state.tail_block_residuals = res
                return output

        def apply_block_hook(block, state_manager, is_tail=False):
            hook = (MendedTail if is_tail else fbc.FBCBlockHook)(state_manager, is_tail)
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, fbc._FBC_BLOCK_HOOK)

        decide = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

        def recorded(hook, residual):
            compute = decide(hook, residual)
            recorder.skipped.setdefault(hook.state_manager.context.name, []).append(not compute)
            return compute

        monkeypatch.setattr(fbc, "_apply_fbc_block_hook", apply_block_hook)
        monkeypatch.setattr(fbc.FBCHeadBlockHook, "_should_compute_remaining_blocks", recorded)
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
        self.transformer = transformer

    def steps(self) -> dict:
        return {name: [i for i, s in enumerate(flags) if s] for name, flags in self.skipped.items()}
