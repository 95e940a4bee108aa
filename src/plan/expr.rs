//! The `expr` of a step: parsed once into an [`Expr`] tree, then normalised into a sum of scaled
//! products ([`Term`]s) that resolution turns into a [`Step`](super::Step).
//!
//! The grammar is Python's for these operators: `@` and `*` bind equally and associate to the
//! left, `+`/`-` bind looser, unary `-` and postfix `.T` bind tighter, parentheses group.
//! Operands are matrix names (`[A-Za-z_][A-Za-z0-9_]*`) and numbers (`2.5`, `1e-3`). The tree
//! represents any such expression (products of many operands, transposed products); a step
//! executes `α·op(F₁)·…·op(Fₙ) + β·C0` ([`ProductForm`]; a chain of more than two factors is cut
//! into sub-products by [`super::chain`]), and [`Expr::terms`] is where `(A @ B).T` becomes
//! `B.T @ A.T` and where sums inside products are refused with the column of the problem.

use std::fmt;

/// A parsed expression. `col` fields are 1-based columns in the expression text.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Expr {
    /// A matrix by name.
    Matrix { name: String, col: usize },
    /// A number literal.
    Number { value: f64, col: usize },
    /// `X.T`.
    Transpose(Box<Expr>),
    /// `X @ Y`; `col` is the column of the `@`.
    Product {
        lhs: Box<Expr>,
        rhs: Box<Expr>,
        col: usize,
    },
    /// `c * X` or `X * c` (one side is a number); `col` is the column of the `*`.
    Scale {
        lhs: Box<Expr>,
        rhs: Box<Expr>,
        col: usize,
    },
    /// `X + Y`.
    Sum(Box<Expr>, Box<Expr>),
    /// `-X`, and the right side of `X - Y`.
    Neg(Box<Expr>),
}

/// An error in an expression, at a 1-based column of its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ExprError {
    pub(crate) col: usize,
    pub(crate) msg: String,
}

impl fmt::Display for ExprError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "column {}: {}", self.col, self.msg)
    }
}

/// One operand of a product: a matrix name, whether it is read transposed, and its column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Factor {
    pub(crate) name: String,
    pub(crate) trans: bool,
    pub(crate) col: usize,
}

/// `coef · factor₁ · factor₂ · …`: one summand of a normalised expression.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Term {
    pub(crate) coef: f64,
    pub(crate) factors: Vec<Factor>,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Name(String),
    Num(f64),
    At,
    Star,
    Plus,
    Minus,
    DotT,
    Open,
    Close,
    End,
}

fn describe(t: &Tok) -> String {
    match t {
        Tok::Name(n) => format!("`{n}`"),
        Tok::Num(v) => format!("the number {v}"),
        Tok::At => "`@`".into(),
        Tok::Star => "`*`".into(),
        Tok::Plus => "`+`".into(),
        Tok::Minus => "`-`".into(),
        Tok::DotT => "`.T`".into(),
        Tok::Open => "`(`".into(),
        Tok::Close => "`)`".into(),
        Tok::End => "the end".into(),
    }
}

fn err<T>(col: usize, msg: impl Into<String>) -> Result<T, ExprError> {
    Err(ExprError {
        col,
        msg: msg.into(),
    })
}

/// Split `src` into tokens with their 1-based columns (in characters).
fn lex(src: &str) -> Result<Vec<(Tok, usize)>, ExprError> {
    let chars: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let col = i + 1;
        let next = chars.get(i + 1).copied();
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        if c.is_ascii_digit() || (c == '.' && next.is_some_and(|n| n.is_ascii_digit())) {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
                i += 1;
            }
            if i < chars.len() && matches!(chars[i], 'e' | 'E') {
                i += 1;
                if i < chars.len() && matches!(chars[i], '+' | '-') {
                    i += 1;
                }
                while i < chars.len() && chars[i].is_ascii_digit() {
                    i += 1;
                }
            }
            let text: String = chars[start..i].iter().collect();
            match text.parse::<f64>() {
                Ok(v) if v.is_finite() => out.push((Tok::Num(v), col)),
                _ => return err(col, format!("`{text}` is not a number")),
            }
            if i < chars.len() && ident(chars[i]) {
                return err(
                    i + 1,
                    "a name cannot start right after a number; write `2 * A`",
                );
            }
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && ident(chars[i]) {
                i += 1;
            }
            out.push((Tok::Name(chars[start..i].iter().collect()), col));
            continue;
        }
        if c == '.' && next == Some('T') && !chars.get(i + 2).is_some_and(|&c| ident(c)) {
            out.push((Tok::DotT, col));
            i += 2;
            continue;
        }
        let tok = match c {
            '@' => Tok::At,
            '*' => Tok::Star,
            '+' => Tok::Plus,
            '-' => Tok::Minus,
            '(' => Tok::Open,
            ')' => Tok::Close,
            '.' => return err(col, "only `.T` (transpose) may follow a `.`"),
            _ => {
                return err(
                    col,
                    format!("unexpected `{c}`; use matrix names, numbers, `@`, `*`, `+`, `-`, `.T` and parentheses"),
                )
            }
        };
        out.push((tok, col));
        i += 1;
    }
    out.push((Tok::End, chars.len() + 1));
    Ok(out)
}

/// The most tokens an expression may have (its tree is at most this deep).
const MAX_TOKENS: usize = 400;

struct Parser {
    toks: Vec<(Tok, usize)>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> &(Tok, usize) {
        &self.toks[self.pos]
    }
    fn bump(&mut self) -> (Tok, usize) {
        let t = self.toks[self.pos].clone();
        if t.0 != Tok::End {
            self.pos += 1;
        }
        t
    }

    /// sum := term (('+' | '-') term)*
    fn sum(&mut self) -> Result<Expr, ExprError> {
        let mut lhs = self.term()?;
        loop {
            match self.peek().0 {
                Tok::Plus => {
                    self.bump();
                    lhs = Expr::Sum(Box::new(lhs), Box::new(self.term()?));
                }
                Tok::Minus => {
                    self.bump();
                    let rhs = Expr::Neg(Box::new(self.term()?));
                    lhs = Expr::Sum(Box::new(lhs), Box::new(rhs));
                }
                _ => return Ok(lhs),
            }
        }
    }

    /// term := unary (('@' | '*') unary)*
    fn term(&mut self) -> Result<Expr, ExprError> {
        let mut lhs = self.unary()?;
        loop {
            let (tok, col) = self.peek().clone();
            match tok {
                Tok::At => {
                    self.bump();
                    let rhs = self.unary()?;
                    for side in [&lhs, &rhs] {
                        if let Some(c) = side.number_col() {
                            return err(c, "`@` multiplies matrices; scale by a number with `*`");
                        }
                    }
                    lhs = Expr::Product {
                        lhs: Box::new(lhs),
                        rhs: Box::new(rhs),
                        col,
                    };
                }
                Tok::Star => {
                    self.bump();
                    let rhs = self.unary()?;
                    if lhs.number_col().is_none() && rhs.number_col().is_none() {
                        return err(
                            col,
                            "`*` scales by a number; multiply matrices with `@` (X @ Y)",
                        );
                    }
                    lhs = Expr::Scale {
                        lhs: Box::new(lhs),
                        rhs: Box::new(rhs),
                        col,
                    };
                }
                _ => return Ok(lhs),
            }
        }
    }

    /// unary := '-' unary | postfix
    fn unary(&mut self) -> Result<Expr, ExprError> {
        if self.peek().0 == Tok::Minus {
            self.bump();
            return Ok(Expr::Neg(Box::new(self.unary()?)));
        }
        self.postfix()
    }

    /// postfix := primary ('.T')*
    fn postfix(&mut self) -> Result<Expr, ExprError> {
        let mut e = self.primary()?;
        while self.peek().0 == Tok::DotT {
            let (_, col) = self.bump();
            if let Some(c) = e.number_col() {
                return err(c.max(col), "`.T` transposes a matrix, not a number");
            }
            e = Expr::Transpose(Box::new(e));
        }
        Ok(e)
    }

    /// primary := NAME | NUMBER | '(' sum ')'
    fn primary(&mut self) -> Result<Expr, ExprError> {
        let (tok, col) = self.bump();
        match tok {
            Tok::Name(name) => Ok(Expr::Matrix { name, col }),
            Tok::Num(value) => Ok(Expr::Number { value, col }),
            Tok::Open => {
                let e = self.sum()?;
                let (close, c) = self.bump();
                if close != Tok::Close {
                    return err(
                        c,
                        format!(
                            "expected `)` to close the `(` at column {col}, found {}",
                            describe(&close)
                        ),
                    );
                }
                Ok(e)
            }
            other => err(
                col,
                format!(
                    "expected a matrix name, a number or `(`, found {}",
                    describe(&other)
                ),
            ),
        }
    }
}

impl Expr {
    /// Parse an expression such as `0.5 * A.T @ B + C0`.
    pub(crate) fn parse(src: &str) -> Result<Expr, ExprError> {
        let toks = lex(src)?;
        // Every later pass walks the tree recursively, and its depth can reach its token count
        // (`((((A))))`, `A.T.T.T…`, `A @ B @ C …`): bounded here, so that a runaway expression is
        // an error rather than a stack overflow.
        if toks.len() > MAX_TOKENS {
            return err(
                toks[MAX_TOKENS].1,
                format!(
                    "the expression is longer than {MAX_TOKENS} symbols; a step multiplies a few matrices (split a longer chain into steps)"
                ),
            );
        }
        let mut p = Parser { toks, pos: 0 };
        if p.peek().0 == Tok::End {
            return err(1, "the expression is empty; write e.g. \"A @ B\"");
        }
        let e = p.sum()?;
        let (tok, col) = p.bump();
        if tok != Tok::End {
            let hint = if tok == Tok::Close {
                "a `)` without its `(`".to_string()
            } else {
                format!(
                    "{} where an operator (`@`, `*`, `+`, `-`) or the end belongs",
                    describe(&tok)
                )
            };
            return err(col, hint);
        }
        Ok(e)
    }

    /// If this is a number (possibly negated or scaled by numbers only), its column.
    fn number_col(&self) -> Option<usize> {
        match self {
            Expr::Number { col, .. } => Some(*col),
            Expr::Neg(e) => e.number_col(),
            Expr::Scale { lhs, rhs, .. } => lhs.number_col().and(rhs.number_col()),
            _ => None,
        }
    }

    /// Normalise into a sum of scaled products: transposes are pushed onto the operands
    /// (`(X @ Y).T` = `Y.T @ X.T`, `X.T.T` = `X`), scalars are multiplied out. A sum inside a
    /// product is refused (it would need a temporary). A bare number is refused.
    pub(crate) fn terms(&self) -> Result<Vec<Term>, ExprError> {
        Ok(match self {
            Expr::Matrix { name, col } => vec![Term {
                coef: 1.0,
                factors: vec![Factor {
                    name: name.clone(),
                    trans: false,
                    col: *col,
                }],
            }],
            Expr::Number { col, .. } => {
                return err(
                    *col,
                    "a number alone is not a matrix; scale a matrix with `*`",
                )
            }
            Expr::Transpose(e) => e
                .terms()?
                .into_iter()
                .map(|t| Term {
                    coef: t.coef,
                    factors: t
                        .factors
                        .into_iter()
                        .rev()
                        .map(|f| Factor {
                            trans: !f.trans,
                            ..f
                        })
                        .collect(),
                })
                .collect(),
            Expr::Product { lhs, rhs, col } => {
                let one = |e: &Expr| -> Result<Term, ExprError> {
                    let mut ts = e.terms()?;
                    if ts.len() != 1 {
                        return err(*col, "a sum inside a product is not supported; compute the sum in its own step (or multiply out)");
                    }
                    Ok(ts.remove(0))
                };
                let (l, r) = (one(lhs)?, one(rhs)?);
                let mut factors = l.factors;
                factors.extend(r.factors);
                vec![Term {
                    coef: l.coef * r.coef,
                    factors,
                }]
            }
            Expr::Scale { lhs, rhs, .. } => {
                let (num, mat) = match (lhs.scalar(), rhs.scalar()) {
                    (Some(v), _) => (v, rhs),
                    (None, Some(v)) => (v, lhs),
                    (None, None) => unreachable!("the parser only builds Scale with a number"),
                };
                scaled(mat.terms()?, num)
            }
            Expr::Sum(a, b) => {
                let mut ts = a.terms()?;
                ts.extend(b.terms()?);
                ts
            }
            Expr::Neg(e) => scaled(e.terms()?, -1.0),
        })
    }

    /// The value of a number-only expression (`2`, `-0.5`, `2 * 3`).
    fn scalar(&self) -> Option<f64> {
        match self {
            Expr::Number { value, .. } => Some(*value),
            Expr::Neg(e) => e.scalar().map(|v| -v),
            Expr::Scale { lhs, rhs, .. } => Some(lhs.scalar()? * rhs.scalar()?),
            _ => None,
        }
    }
}

fn scaled(ts: Vec<Term>, by: f64) -> Vec<Term> {
    ts.into_iter()
        .map(|t| Term {
            coef: t.coef * by,
            factors: t.factors,
        })
        .collect()
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Matrix { name, .. } => write!(f, "{name}"),
            Expr::Number { value, .. } => write!(f, "{value}"),
            Expr::Transpose(e) => write!(f, "({e}).T"),
            Expr::Product { lhs, rhs, .. } => write!(f, "({lhs} @ {rhs})"),
            Expr::Scale { lhs, rhs, .. } => write!(f, "({lhs} * {rhs})"),
            Expr::Sum(a, b) => write!(f, "({a} + {b})"),
            Expr::Neg(e) => write!(f, "-({e})"),
        }
    }
}

/// What one `[[step]]` computes: `alpha · op(F₁) · op(F₂) · … + beta · c0` — two factors
/// for one product, more for a chain that resolution cuts into sub-products.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ProductForm {
    /// At least two.
    pub(crate) factors: Vec<Factor>,
    pub(crate) alpha: f64,
    /// The added matrix and its coefficient, when the expression has `+ β·C0`.
    pub(crate) c0: Option<(Factor, f64)>,
}

/// The message for a sum of several products.
pub(crate) const MULTI_PRODUCT: &str =
    "a sum of several products is not supported; compute each product in its own step (give it a `name`) and add one of them as C0";

impl ProductForm {
    /// Reduce normalised terms to the one form a step executes.
    pub(crate) fn from_terms(terms: &[Term]) -> Result<ProductForm, ExprError> {
        let (prods, adds): (Vec<&Term>, Vec<&Term>) =
            terms.iter().partition(|t| t.factors.len() >= 2);
        let prod = match prods.as_slice() {
            [] => {
                let col = terms.first().map_or(1, |t| t.factors[0].col);
                return err(
                    col,
                    "no product; a step computes X @ Y (each side a matrix name, optionally with .T)",
                );
            }
            [p] => *p,
            [_, second, ..] => return err(second.factors[0].col, MULTI_PRODUCT),
        };
        let c0 =
            match adds.as_slice() {
                [] => None,
                [c] if c.factors[0].trans => return err(
                    c.factors[0].col,
                    "the added matrix cannot be transposed; store C0 in the product's orientation",
                ),
                [c] => Some((c.factors[0].clone(), c.coef)),
                [_, second, ..] => {
                    return err(
                        second.factors[0].col,
                        "only one matrix can be added to the product (X @ Y + beta * C0)",
                    )
                }
            };
        Ok(ProductForm {
            factors: prod.factors.clone(),
            alpha: prod.coef,
            c0,
        })
    }
}

/// Parse `src` and reduce it to the form a step executes.
pub(crate) fn product_form(src: &str) -> Result<ProductForm, ExprError> {
    ProductForm::from_terms(&Expr::parse(src)?.terms()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runaway_expression_is_an_error_not_a_stack_overflow() {
        for src in [
            format!("{}A @ B{}", "(".repeat(10_000), ")".repeat(10_000)),
            format!("{}A @ B", "-".repeat(50_000)),
            format!("A{} @ B", ".T".repeat(50_000)),
        ] {
            let e = product_form(&src).unwrap_err();
            assert!(e.msg.contains("longer than 400 symbols"), "{}", e.msg);
        }
        // The longest allowed one is parsed and reduced on a small thread stack.
        let deep = format!("{}A @ B{}", "(".repeat(198), ")".repeat(198));
        let form = std::thread::Builder::new()
            .stack_size(512 << 10)
            .spawn(move || product_form(&deep).map(|p| p.factors.len()))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(form.unwrap(), 2);
    }

    fn f(name: &str, trans: bool) -> (String, bool) {
        (name.to_string(), trans)
    }
    /// (a, b, alpha, (c0, beta)) with each operand as (name, transposed).
    type Form = ((String, bool), (String, bool), f64, Option<(String, f64)>);
    fn form(src: &str) -> Form {
        let p = product_form(src).unwrap_or_else(|e| panic!("{src}: {e}"));
        (
            (p.factors[0].name.clone(), p.factors[0].trans),
            (p.factors[1].name.clone(), p.factors[1].trans),
            p.alpha,
            p.c0.map(|(c, beta)| (c.name, beta)),
        )
    }
    fn fails(src: &str) -> ExprError {
        match product_form(src) {
            Ok(p) => panic!("{src} should fail, got {p:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn todays_forms_are_the_simplest_case() {
        assert_eq!(form("A @ B"), (f("A", false), f("B", false), 1.0, None));
        assert_eq!(form("A.T @ B"), (f("A", true), f("B", false), 1.0, None));
        assert_eq!(form("A@B.T"), (f("A", false), f("B", true), 1.0, None));
        assert_eq!(form(" X.T @ Y.T "), (f("X", true), f("Y", true), 1.0, None));
        assert_eq!(
            form("AB @ C_1"),
            (f("AB", false), f("C_1", false), 1.0, None)
        );
        assert_eq!(form("A .T @ B"), (f("A", true), f("B", false), 1.0, None));
    }

    #[test]
    fn scalars_and_sums() {
        assert_eq!(form("2.5 * A @ B").2, 2.5);
        assert_eq!(form("A @ B * 0.5").2, 0.5);
        assert_eq!(form("A @ (2 * B) * 3").2, 6.0);
        assert_eq!(form("-A @ B").2, -1.0);
        assert_eq!(form("1e-3 * A @ B").2, 1e-3);
        assert_eq!(
            form("0.5 * A.T @ B - C0"),
            (f("A", true), f("B", false), 0.5, Some(("C0".into(), -1.0)))
        );
        assert_eq!(
            form("2 * C0 + A @ B"),
            (f("A", false), f("B", false), 1.0, Some(("C0".into(), 2.0)))
        );
    }

    #[test]
    fn precedence_and_parentheses() {
        // `@` and `*` bind equally, left to right; `+` looser; `.T` tightest.
        let e = Expr::parse("2 * A @ B + C").unwrap();
        assert_eq!(e.to_string(), "(((2 * A) @ B) + C)");
        let e = Expr::parse("A @ B.T").unwrap();
        assert_eq!(e.to_string(), "(A @ (B).T)");
        let e = Expr::parse("(A @ B).T").unwrap();
        assert_eq!(e.to_string(), "((A @ B)).T");
        let e = Expr::parse("A @ (B @ C)").unwrap();
        assert_eq!(e.to_string(), "(A @ (B @ C))");
    }

    #[test]
    fn transposed_product_swaps_operands() {
        assert_eq!(form("(A @ B).T"), (f("B", true), f("A", true), 1.0, None));
        assert_eq!(
            form("(A.T @ B).T"),
            (f("B", true), f("A", false), 1.0, None)
        );
        assert_eq!(form("A.T.T @ B"), (f("A", false), f("B", false), 1.0, None));
        assert_eq!(form("(2 * A @ B).T").2, 2.0);
    }

    #[test]
    fn chains_keep_every_factor_and_transpose_reverses_them() {
        let p = product_form("A @ B @ C").unwrap();
        let names: Vec<(&str, bool)> = p
            .factors
            .iter()
            .map(|f| (f.name.as_str(), f.trans))
            .collect();
        assert_eq!(names, [("A", false), ("B", false), ("C", false)]);
        let p = product_form("(A @ B @ C).T").unwrap();
        let names: Vec<(&str, bool)> = p
            .factors
            .iter()
            .map(|f| (f.name.as_str(), f.trans))
            .collect();
        assert_eq!(names, [("C", true), ("B", true), ("A", true)]);
        let p = product_form("A.T @ (B @ C)").unwrap();
        assert_eq!((p.factors.len(), p.factors[0].trans), (3, true));
        assert_eq!(product_form("2.5 * A @ B @ C + D").unwrap().alpha, 2.5);
        let e = fails("A @ B + C @ D");
        assert_eq!(e.col, 9);
        assert!(e.msg.contains("sum of several products"), "{e}");
    }

    #[test]
    fn errors_name_the_column() {
        let e = fails("A * D");
        assert_eq!(e.col, 3);
        assert!(e.msg.contains("X @ Y"), "{e}");
        assert_eq!(fails("A @ @ B").col, 5);
        assert_eq!(fails("A @").col, 4);
        assert_eq!(fails("").col, 1);
        assert_eq!(fails("A @ B)").col, 6);
        let e = fails("(A @ B");
        assert_eq!(e.col, 7);
        assert!(e.msg.contains("column 1"), "{e}");
        assert_eq!(fails("A @ B$").col, 6);
        assert_eq!(fails("A B").col, 3);
        assert_eq!(fails("2 @ B").col, 1);
        assert_eq!(fails("A.X @ B").col, 2);
        assert_eq!(fails("A").col, 1);
        assert_eq!(fails("A @ B + C.T").col, 9);
        assert_eq!(fails("(A + B) @ C").col, 9);
        assert_eq!(fails("A @ B + 1").col, 9);
        assert_eq!(fails("2A @ B").col, 2);
        assert_eq!(
            fails("A @ 2").to_string(),
            "column 5: `@` multiplies matrices; scale by a number with `*`"
        );
    }
}
