//! Whole expressions in one step: a product of several operands (`A @ B @ C`, `(A @ B @ C).T`)
//! ordered by cost and cut into two-operand sub-products, each an ordinary step with its own
//! journal, whose intermediates are temporary files next to the output.
//!
//! The order comes from the classic matrix-chain dynamic program over the operands' shapes, with
//! an I/O-aware cost: the FLOPs of each product, plus — for an intermediate larger than the host
//! memory budget, which must really go through the disk — the bytes written and read back,
//! weighted at [`IO_WEIGHT`] FLOPs per byte. An intermediate that fits in memory is still written
//! to a temporary file (the page cache usually keeps it; holding it in device or host memory
//! without a file is not implemented). A transposed result needs no second pass: `.T` was pushed
//! onto the operands when the expression was normalised (`(XY)ᵀ = YᵀXᵀ`), and an intermediate
//! whose operands are both transposed is computed untransposed and read with `.T`, so
//! `(A @ B @ C).T` computes `A @ B` exactly as the two-step plan does.

use std::path::{Path, PathBuf};

use super::Operand;

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
    /// What `plan` prints for this part: on the first part, the chosen order and its cost beside
    /// the naive left-to-right order's; on every part, its sub-product and cost, and where an
    /// intermediate goes.
    pub(crate) fn describe(&self, out_bytes: u64) -> String {
        let mut s = String::new();
        if self.part == 1 {
            s += &format!(
                "  chain: {} sub-products in the order {} — cost {:.3e} (FLOPs + {IO_WEIGHT:.0e}·bytes of intermediates bigger than host_memory); naive left to right {}: {:.3e} ({:.2}×)\n",
                self.parts,
                self.order,
                self.order_cost,
                self.naive,
                self.naive_cost,
                self.naive_cost / self.order_cost.max(1.0)
            );
        }
        s += &format!(
            "  part {}/{}: {} — cost {:.3e}{}\n",
            self.part,
            self.parts,
            self.text,
            self.cost,
            if self.part < self.parts {
                format!(
                    "; intermediate {} bytes in a temporary file, removed when the chain completes",
                    out_bytes
                )
            } else {
                String::new()
            }
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

fn label(o: &Operand) -> String {
    format!("{}{}", o.name, if o.trans { ".T" } else { "" })
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
        let text = format!("{} = {} @ {}", output.display(), label(&a), label(&b));
        out.push(SubProduct {
            a,
            b,
            output: output.to_path_buf(),
            temp: false,
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
    let plain = format!("{tname} = {} @ {}", label(&a), label(&b));
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
            label(&sa),
            label(&sb)
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
        raw: None,
        temp: true,
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
}
