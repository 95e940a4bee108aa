//! Published fp64 and int8 rates of GPUs, for `plan`'s note that `precision = "fp64_emulated"`
//! exists where it pays: a GPU whose native fp64 is a small fraction of its int8 tensor-core
//! rate (consumer cards run fp64 at 1/64 of fp32) computes an fp64 product faster on int8.
//!
//! The model: emulated ≈ int8 rate × 0.65 / (N + 1) — N moduli for the block's depth, one
//! integer GEMM more for the accuracy bound, 0.65 the share of its published dense int8 rate
//! that cuBLAS's int8 TN GEMM reached on an H200 (1,284 of 1,979 TOP/s, docs/GPU.md) — against
//! native ≈ fp64 rate × 0.83 (DGEMM reached 55.5 of 67 TFLOP/s there). Published rates are
//! dense (no sparsity), fp64 on the tensor cores where the GPU has them.

/// Published dense rates of one GPU model, TFLOP/s (fp64) and TOP/s (int8).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Rates {
    pub(crate) fp64: f64,
    pub(crate) int8: f64,
}

/// (name fragment, rates), the first fragment found in the device's name wins (longer ones
/// first where one contains another).
const TABLE: &[(&str, Rates)] = &[
    (
        "GH200",
        Rates {
            fp64: 67.0,
            int8: 1979.0,
        },
    ),
    (
        "H200",
        Rates {
            fp64: 67.0,
            int8: 1979.0,
        },
    ),
    (
        "H100 PCIe",
        Rates {
            fp64: 51.0,
            int8: 1513.0,
        },
    ),
    (
        "H100",
        Rates {
            fp64: 67.0,
            int8: 1979.0,
        },
    ),
    (
        "B200",
        Rates {
            fp64: 40.0,
            int8: 4500.0,
        },
    ),
    (
        "A100",
        Rates {
            fp64: 19.5,
            int8: 624.0,
        },
    ),
    (
        "RTX 6000 Ada",
        Rates {
            fp64: 1.42,
            int8: 728.5,
        },
    ),
    (
        "RTX A6000",
        Rates {
            fp64: 1.25,
            int8: 309.7,
        },
    ),
    (
        "RTX 4090",
        Rates {
            fp64: 1.29,
            int8: 660.6,
        },
    ),
    (
        "RTX 3090",
        Rates {
            fp64: 0.556,
            int8: 284.0,
        },
    ),
    (
        "L4",
        Rates {
            fp64: 0.49,
            int8: 242.0,
        },
    ),
];

/// Share of the published rate cuBLAS reaches: int8 TN GEMM, DGEMM (measured on an H200).
const INT8_EFFICIENCY: f64 = 0.65;
const FP64_EFFICIENCY: f64 = 0.83;
/// The whole emulated block against its int8 GEMMs alone: the element-wise kernels (scaling,
/// residues, reduction, rebuild) around them. Measured kernel by kernel on an H100 for one
/// 8192³ block of the second kernels (`tools/probes/ozaki_kernel_times.py`, 2026-12-06,
/// docs/measurements/2026-12-06-h100-1-fp64e-v2-kept-backend.log): 19.8 ms of int8 GEMMs,
/// 14.1 ms of the rest — 1.71 times (the first kernels: 3.2 on an H200 at 32768²).
const EMULATION_OVERHEAD: f64 = 1.71;

/// The published rates of the GPU named `name` (as the driver names it), if known.
pub(crate) fn published(name: &str) -> Option<Rates> {
    TABLE
        .iter()
        .find(|(k, _)| name.contains(k))
        .map(|(_, r)| *r)
}

/// Predicted speed of `fp64_emulated` over native fp64 on a GPU of `rates`, with `moduli`
/// moduli per block.
pub(crate) fn emulation_speedup(rates: Rates, moduli: usize) -> f64 {
    (rates.int8 * INT8_EFFICIENCY / (moduli + 1) as f64 / EMULATION_OVERHEAD)
        / (rates.fp64 * FP64_EFFICIENCY)
}

/// `plan`'s note for a native fp64 step on the GPU named `name`, when the model predicts
/// `fp64_emulated` at least 1.2 times as fast there with `moduli` moduli per block.
pub(crate) fn emulation_hint(name: &str, moduli: usize) -> Option<String> {
    let r = published(name)?;
    let x = emulation_speedup(r, moduli);
    (x >= 1.2).then(|| {
        format!(
            "this GPU ({name}) runs fp64 at {} TFLOP/s but int8 at {} TOP/s (published, dense): precision = \"fp64_emulated\" computes the same fp64 product on its int8 tensor cores, every element within native DGEMM's bound or that block computed natively, predicted about {x:.1}× as fast here ({moduli} moduli per block; docs/PLAN.md).",
            r.fp64, r.int8
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weak_fp64_cards_get_the_note_and_the_model_is_what_it_says() {
        let hint = emulation_hint("NVIDIA GeForce RTX 4090", 15).expect("a 4090 is told");
        assert!(
            hint.contains("fp64_emulated") && hint.contains("1.29 TFLOP/s"),
            "{hint}"
        );
        // 660.6·0.65/16/1.71 against 1.29·0.83: about 14.7×.
        let x = emulation_speedup(published("NVIDIA GeForce RTX 4090").unwrap(), 15);
        assert!((x - 14.66).abs() < 0.1, "{x}");
        // An H200: 1979·0.65/16/1.71 = 47.0 against 67·0.83 = 55.6, about 0.85× (an H100
        // measured 0.56× in core — its int8 TN GEMM ran at 980 TOP/s, not the H200's 1,284 — and
        // 0.90× the engine's own native path from .npy): no note.
        let h = emulation_speedup(published("NVIDIA H200").unwrap(), 15);
        assert!((h - 0.845).abs() < 0.02, "{h}");
        assert!(emulation_hint("NVIDIA H200", 15).is_none());
        assert!(emulation_hint("NVIDIA H100 PCIe", 15).is_none());
        assert_eq!(published("NVIDIA H100 PCIe").unwrap().fp64, 51.0);
        assert!(
            emulation_hint("Tesla V100-SXM2-16GB", 15).is_none(),
            "unknown: no note"
        );
        // Sixteen moduli and more GEMMs than an A100's ratio pays for: no note.
        assert!(emulation_speedup(published("A100").unwrap(), 16) < 1.5);
    }
}
