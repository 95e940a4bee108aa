//! Whole expressions in one step: a product of several operands (`A @ B @ C`, `(A @ B @ C).T`)
//! ordered by cost and cut into two-operand sub-products, each an ordinary step. An intermediate
//! that fits in the chain's memory budget ([`memory_budget`]: half of `engine.host_memory`) is
//! held in host memory and never touches the disk; a bigger one is a temporary file next to the
//! output (`OUTPUT.partN.mgt`, with its own journal), removed when the chain completes. Split
//! runs write every intermediate to its file, since other processes read it.
//!
//! The order comes from the classic matrix-chain dynamic program over the operands' shapes, with
//! an I/O-aware cost: the FLOPs of each product, plus — for an intermediate larger than the
//! memory budget, which must really go through the disk — the bytes written and read back,
//! weighted at [`IO_WEIGHT`] FLOPs per byte. A transposed result needs no second pass: `.T` was pushed
//! onto the operands when the expression was normalised (`(XY)ᵀ = YᵀXᵀ`), and an intermediate
//! whose operands are both transposed is computed untransposed and read with `.T`, so
//! `(A @ B @ C).T` computes `A @ B` exactly as the two-step plan does.

use std::path::{Path, PathBuf};

use super::Operand;
use crate::units::fmt_bytes;

/// Bytes of host memory a chain may hold its intermediates in: half of `engine.host_memory`.
/// The intermediates alive at the same time (the one being written and those still to be read)
/// must fit together; they are held beside the pipeline's own pools, which `host_memory` bounds
/// on its own, so a chain's process holds at most 1.5 × `host_memory`.
pub(crate) fn memory_budget(host_memory: u64) -> u64 {
    host_memory / 2
}

/// FLOPs one byte through the disk is worth: between the CPU backend (~300 GFLOP/s against a
/// 1.6 GB/s disk: 190) and an H200 (54 TFLOP/s: 34 000), on the GPU side since that is where
/// chains are big.
pub(crate) const IO_WEIGHT: f64 = 1e4;

/// How a chain was cut, kept on each of its steps.
#[derive(Clone, Debug)]
pub struct ChainPart {
    /// 1-based position of this sub-product among the chain's steps, and their number.
    pub part: usize,
    pub parts: usize,
    /// The chain's final output (the last part's output).
    pub root_output: PathBuf,
    /// Every intermediate file of the chain (removed after the last part completes).
    pub temps: Vec<PathBuf>,
    /// The intermediates (by their file's path) that an unsplit run holds in host memory
    /// instead; a split run writes them to their files like the others.
    pub memory: Vec<PathBuf>,
    /// The chain's inputs, whose identities go into every part's journal fingerprint.
    pub leaves: Vec<Operand>,
    /// This sub-product as text (`T1 = B @ C`) and its cost.
    pub text: String,
    pub cost: f64,
    /// The chosen order and its cost, and the naive left-to-right order and its cost.
    pub order: String,
    pub order_cost: f64,
    pub naive: String,
    pub naive_cost: f64,
}

impl ChainPart {
    /// The name of what this part computes: `T1` for an intermediate, the output's path for
    /// the last part (the left side of [`Self::text`]).
    pub(crate) fn result_name(&self) -> &str {
        self.text.split(" = ").next().unwrap_or(&self.text)
    }

    /// What `plan` prints for this part: on the first part, the chosen order and its cost beside
    /// the naive left-to-right order's; on every part, its sub-product and cost, and where an
    /// intermediate goes: `output` held in memory (`mem_bytes`) or in its file (`file_bytes`).
    pub(crate) fn describe(&self, output: &Path, mem_bytes: u64, file_bytes: u64) -> String {
        let mut s = String::new();
        if self.part == 1 {
            s += &format!(
                "  chain: {} sub-products in the order {} — cost {:.3e} (FLOPs + {IO_WEIGHT:.0e}·bytes of intermediates bigger than half of host_memory); naive left to right {}: {:.3e} ({:.2}×)\n",
                self.parts,
                self.order,
                self.order_cost,
                self.naive,
                self.naive_cost,
                self.naive_cost / self.order_cost.max(1.0)
            );
        }
        let place = if self.part == self.parts {
            String::new()
        } else if self.memory.iter().any(|p| p == output) {
            format!(
                "; intermediate {} stays in host memory (within half of host_memory; a split run writes it to the temporary file {})",
                fmt_bytes(mem_bytes),
                output.display()
            )
        } else {
            format!(
                "; intermediate {} in the temporary file {}, removed when the chain completes",
                fmt_bytes(file_bytes),
                output.display()
            )
        };
        s += &format!(
            "  part {}/{}: {} — cost {:.3e}{place}\n",
            self.part, self.parts, self.text, self.cost,
        );
        s
    }
}

/// A product tree over operands `0..n`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tree {
    Leaf(usize),
    Node(Box<Tree>, Box<Tree>),
}

impl Tree {
    /// The tree as text with `names` for the leaves: `(A @ (B @ C))`.
    pub(crate) fn show(&self, names: &[String]) -> String {
        match self {
            Tree::Leaf(i) => names[i.to_owned()].clone(),
            Tree::Node(l, r) => format!("({} @ {})", l.show(names), r.show(names)),
        }
    }
    fn span(&self) -> (usize, usize) {
        match self {
            Tree::Leaf(i) => (*i, *i),
            Tree::Node(l, r) => (l.span().0, r.span().1),
        }
    }
}

/// Cost of one product `m×k · k×n`; `intermediate` results bigger than `mem` bytes pay for
/// being written and read back.
pub(crate) fn product_cost(m: u64, k: u64, n: u64, intermediate: bool, mem: u64, elem: u64) -> f64 {
    let flops = 2.0 * m as f64 * k as f64 * n as f64;
    let bytes = m as f64 * n as f64 * elem as f64;
    if intermediate && bytes > mem as f64 {
        flops + IO_WEIGHT * 2.0 * bytes
    } else {
        flops
    }
}

/// Total cost of `tree` over shapes `dims` (operand i is `dims[i] × dims[i+1]`).
pub(crate) fn tree_cost(tree: &Tree, dims: &[u64], mem: u64, elem: u64) -> f64 {
    let n = dims.len() - 1;
    fn go(t: &Tree, d: &[u64], n: usize, mem: u64, elem: u64) -> f64 {
        match t {
            Tree::Leaf(_) => 0.0,
            Tree::Node(l, r) => {
                let (i, j) = t.span();
                let k = l.span().1 + 1;
                let own = product_cost(d[i], d[k], d[j + 1], (i, j) != (0, n - 1), mem, elem);
                go(l, d, n, mem, elem) + go(r, d, n, mem, elem) + own
            }
        }
    }
    go(tree, dims, n, mem, elem)
}

/// The naive left-to-right order `((A @ B) @ C) @ …`.
pub(crate) fn left_to_right(n: usize) -> Tree {
    (1..n).fold(Tree::Leaf(0), |t, i| {
        Tree::Node(Box::new(t), Box::new(Tree::Leaf(i)))
    })
}

/// The right-to-left order `A @ (B @ (C @ …))`: a transposed product's naive order as
/// written, its factors reversed.
pub(crate) fn right_to_left(n: usize) -> Tree {
    (0..n - 1).rev().fold(Tree::Leaf(n - 1), |t, i| {
        Tree::Node(Box::new(Tree::Leaf(i)), Box::new(t))
    })
}

/// The cheapest order of the chain with shapes `dims` (the matrix-chain dynamic program, with
/// ties going to the left-to-right split so that equal costs keep the order as written).
pub(crate) fn best_order(dims: &[u64], mem: u64, elem: u64) -> Tree {
    let n = dims.len() - 1;
    let mut cost = vec![vec![0.0f64; n]; n];
    let mut split = vec![vec![0usize; n]; n];
    for len in 2..=n {
        for i in 0..=n - len {
            let j = i + len - 1;
            let whole = (i, j) == (0, n - 1);
            let mut best = (f64::INFINITY, i);
            for k in (i..j).rev() {
                let c = cost[i][k]
                    + cost[k + 1][j]
                    + product_cost(dims[i], dims[k + 1], dims[j + 1], !whole, mem, elem);
                if c < best.0 {
                    best = (c, k);
                }
            }
            (cost[i][j], split[i][j]) = best;
        }
    }
    fn build(split: &[Vec<usize>], i: usize, j: usize) -> Tree {
        if i == j {
            return Tree::Leaf(i);
        }
        let k = split[i][j];
        Tree::Node(
            Box::new(build(split, i, k)),
            Box::new(build(split, k + 1, j)),
        )
    }
    build(&split, 0, n - 1)
}

/// One two-operand product of a chain, in execution order.
#[derive(Clone, Debug)]
pub(crate) struct SubProduct {
    pub(crate) a: Operand,
    pub(crate) b: Operand,
    /// Where it is written: a temporary file, or the step's output for the last one.
    pub(crate) output: PathBuf,
    pub(crate) temp: bool,
    /// An intermediate held in host memory (in an unsplit run), set by [`place_in_memory`].
    pub(crate) memory: bool,
    pub(crate) text: String,
    pub(crate) cost: f64,
}

/// Cut `tree` over `leaves` into sub-products (post-order), naming intermediates
/// `OUTPUT.partN.mgt` next to `output`.
pub(crate) fn sub_products(
    tree: &Tree,
    leaves: &[Operand],
    output: &Path,
    mem: u64,
    elem: u64,
) -> Vec<SubProduct> {
    let mut out = Vec::new();
    emit(tree, leaves, output, mem, elem, true, &mut out);
    out
}

fn emit(
    t: &Tree,
    leaves: &[Operand],
    output: &Path,
    mem: u64,
    elem: u64,
    root: bool,
    out: &mut Vec<SubProduct>,
) -> Operand {
    let (l, r) = match t {
        Tree::Leaf(i) => return leaves[*i].clone(),
        Tree::Node(l, r) => (l, r),
    };
    let a = emit(l, leaves, output, mem, elem, false, out);
    let b = emit(r, leaves, output, mem, elem, false, out);
    let (m, k) = a.op_shape();
    let n = b.op_shape().1;
    let cost = product_cost(m, k, n, !root, mem, elem);
    if root {
        let text = format!(
            "{} = {} @ {}",
            output.display(),
            a.read_label(),
            b.read_label()
        );
        out.push(SubProduct {
            a,
            b,
            output: output.to_path_buf(),
            temp: false,
            memory: false,
            text,
            cost,
        });
        return leaves[0].clone();
    }
    let id = out.len() + 1;
    let mut name = output.as_os_str().to_owned();
    name.push(format!(".part{id}.mgt"));
    let path = PathBuf::from(name);
    let tname = format!("T{id}");
    // Both operands transposed: compute the untransposed Rᵀ = op(b)ᵀ·op(a)ᵀ and read it with .T.
    let flip = a.trans && b.trans;
    let plain = format!("{tname} = {} @ {}", a.read_label(), b.read_label());
    let (sa, sb, trans, (rows, cols)) = if flip {
        let un = |o: &Operand| Operand {
            trans: false,
            ..o.clone()
        };
        (un(&b), un(&a), true, (n, m))
    } else {
        (a, b, false, (m, n))
    };
    let text = if flip {
        format!(
            "{plain}, stored untransposed as {} @ {} and read with .T",
            sa.read_label(),
            sb.read_label()
        )
    } else {
        plain
    };
    let dtype = sa.dtype;
    out.push(SubProduct {
        a: sa,
        b: sb,
        output: path.clone(),
        temp: true,
        memory: false,
        text,
        cost,
    });
    Operand {
        name: tname,
        path,
        rows,
        cols,
        dtype,
        trans,
        stored_t: false,
        raw: None,
        temp: true,
    }
}

/// Choose which intermediates of `subs` (in execution order) an unsplit run holds in memory:
/// each in turn, while it fits in `budget` bytes together with the in-memory intermediates still
/// alive when it is written (those not yet read by a later sub-product, its own operands
/// included). An intermediate stores `elem`-byte elements.
pub(crate) fn place_in_memory(subs: &mut [SubProduct], budget: u64, elem: u64) {
    let mut live: Vec<(PathBuf, u64)> = Vec::new();
    for p in subs.iter_mut() {
        if p.temp {
            let bytes = p.a.op_shape().0 * p.b.op_shape().1 * elem;
            let used: u64 = live.iter().map(|l| l.1).sum();
            if used.saturating_add(bytes) <= budget {
                live.push((p.output.clone(), bytes));
                p.memory = true;
            }
        }
        live.retain(|(path, _)| ![&p.a, &p.b].iter().any(|o| o.temp && &o.path == path));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_program_finds_the_classic_optimum() {
        // CLRS 15.2: p = 30 35 15 5 10 20 25, optimum ((A1(A2A3))((A4A5)A6)) = 15125 mults.
        let dims = [30, 35, 15, 5, 10, 20, 25];
        let t = best_order(&dims, u64::MAX, 4);
        let names: Vec<String> = (1..=6).map(|i| format!("A{i}")).collect();
        assert_eq!(t.show(&names), "((A1 @ (A2 @ A3)) @ ((A4 @ A5) @ A6))");
        assert_eq!(tree_cost(&t, &dims, u64::MAX, 4), 2.0 * 15125.0);
        assert_eq!(
            tree_cost(&left_to_right(6), &dims, u64::MAX, 4),
            2.0 * 40500.0
        );
    }

    #[test]
    fn the_43_gb_request_keeps_the_small_intermediate() {
        // (A·B·C)ᵀ with A 3000×100, B 100×100, C 100×3.6M, as Cᵀ·Bᵀ·Aᵀ.
        let dims = [3_600_000, 100, 100, 3000];
        let t = best_order(&dims, 2 << 30, 4);
        let n: Vec<String> = ["C.T", "B.T", "A.T"].map(String::from).to_vec();
        assert_eq!(t.show(&n), "(C.T @ (B.T @ A.T))");
        // Left to right makes a 1.44 GB intermediate and 36× the FLOPs of the first product.
        assert!(tree_cost(&left_to_right(3), &dims, 1 << 30, 4) > tree_cost(&t, &dims, 1 << 30, 4));
    }

    #[test]
    fn io_weight_can_change_the_order() {
        // A 1×2, B 2×5, C 5×2: left to right is fewer FLOPs (40 against 48) but its 1×5
        // intermediate (20 bytes) does not fit in 16 bytes of memory while B·C (2×2) does.
        let dims = [1, 2, 5, 2];
        let names: Vec<String> = ["A", "B", "C"].map(String::from).to_vec();
        assert_eq!(best_order(&dims, u64::MAX, 4).show(&names), "((A @ B) @ C)");
        assert_eq!(best_order(&dims, 16, 4).show(&names), "(A @ (B @ C))");
    }

    #[test]
    fn intermediates_alive_together_share_the_memory_budget() {
        // ((A @ B) @ (C @ D)) over 10×10 operands: T1 and T2 (400 bytes each in f32) are both
        // alive when the root is computed.
        let op = |name: &str| Operand {
            name: name.into(),
            path: PathBuf::from(format!("{name}.mgt")),
            rows: 10,
            cols: 10,
            dtype: crate::dtype::DType::F32,
            trans: false,
            stored_t: false,
            raw: None,
            temp: false,
        };
        let leaves: Vec<Operand> = ["A", "B", "C", "D"].iter().map(|n| op(n)).collect();
        let tree = Tree::Node(
            Box::new(Tree::Node(Box::new(Tree::Leaf(0)), Box::new(Tree::Leaf(1)))),
            Box::new(Tree::Node(Box::new(Tree::Leaf(2)), Box::new(Tree::Leaf(3)))),
        );
        let placed = |budget| {
            let mut subs = sub_products(&tree, &leaves, Path::new("D.npy"), budget, 4);
            place_in_memory(&mut subs, budget, 4);
            subs.iter().map(|s| s.memory).collect::<Vec<_>>()
        };
        assert_eq!(placed(800), [true, true, false]);
        assert_eq!(placed(799), [true, false, false]);
        assert_eq!(placed(399), [false, false, false]);
        // Left to right: T1 is read (and freed) by the step that writes T2.
        let mut subs = sub_products(&left_to_right(4), &leaves, Path::new("D.npy"), 800, 4);
        place_in_memory(&mut subs, 800, 4);
        assert_eq!(
            subs.iter().map(|s| s.memory).collect::<Vec<_>>(),
            [true, true, false]
        );
        let mut subs = sub_products(&left_to_right(4), &leaves, Path::new("D.npy"), 799, 4);
        place_in_memory(&mut subs, 799, 4);
        assert_eq!(
            subs.iter().map(|s| s.memory).collect::<Vec<_>>(),
            [true, false, false]
        );
    }
}
