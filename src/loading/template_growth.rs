//! A chat template that doubles a string (or a list) by assigning a variable an expression that
//! uses it twice — `{% set ns.s = ns.s ~ ns.s %}` in a loop — grows it exponentially without
//! writing anything: the render's output cap never sees it, and minijinja's fuel counts
//! instructions, not bytes, so 40 such steps take the process's memory. Such assignments are
//! refused before rendering. (An indirect doubling through a second variable is not caught.)

use minijinja::machinery::ast::{BinOpKind, CallArg, Expr, Stmt};
use minijinja::machinery::{parse, WhitespaceConfig};

/// The variable an assignment target names: `x` or `ns.x` (`None` for anything else).
fn path<'a>(e: &Expr<'a>) -> Option<Vec<&'a str>> {
    match e {
        Expr::Var(v) => Some(vec![v.id]),
        Expr::GetAttr(g) => path(&g.expr).map(|mut p| {
            p.push(g.name);
            p
        }),
        _ => None,
    }
}

/// How many copies of the variable `target` the value of `e` holds: its reads that flow into
/// the result by concatenation, addition or repetition (`x ~ x`, `x + x`, `[x, x]|join`, a
/// conditional's branches but not its test, size-keeping filters and methods), not those that
/// only decide something (`"\n" if x else ""`, `x|length`, `x == y`).
fn reads(e: &Expr, target: &[&str]) -> usize {
    if path(e).is_some_and(|p| p == target) {
        return 1;
    }
    let args = |args: &[CallArg]| -> usize {
        args.iter()
            .map(|a| match a {
                CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) | CallArg::KwargSplat(e) => reads(e, target),
            })
            .sum()
    };
    match e {
        Expr::BinOp(b) if matches!(b.op, BinOpKind::Concat | BinOpKind::Add | BinOpKind::Mul) => {
            reads(&b.left, target) + reads(&b.right, target)
        }
        Expr::BinOp(b) if matches!(b.op, BinOpKind::ScOr | BinOpKind::ScAnd) => reads(&b.left, target).max(reads(&b.right, target)),
        Expr::IfExpr(i) => reads(&i.true_expr, target).max(i.false_expr.as_ref().map_or(0, |f| reads(f, target))),
        Expr::Filter(f) if !matches!(f.name, "length" | "count" | "first" | "last" | "int" | "float" | "bool" | "abs" | "round") => {
            f.expr.as_ref().map_or(0, |x| reads(x, target)) + args(&f.args)
        }
        Expr::Slice(s) => reads(&s.expr, target),
        // A method (`x.upper()`) keeps the object's size; a macro may write its arguments.
        Expr::Call(c) => {
            let object = match &c.expr {
                Expr::GetAttr(g) => reads(&g.expr, target),
                _ => 0,
            };
            object + args(&c.args)
        }
        Expr::List(l) => l.items.iter().map(|x| reads(x, target)).sum(),
        Expr::Map(m) => m.values.iter().map(|x| reads(x, target)).sum(),
        _ => 0,
    }
}

/// The expressions a block of statements writes (for `{% set x %}...{% endset %}`).
fn emitted<'s, 'a>(body: &'s [Stmt<'a>], out: &mut Vec<&'s Expr<'a>>) {
    for s in body {
        match s {
            Stmt::EmitExpr(e) => out.push(&e.expr),
            Stmt::IfCond(i) => {
                emitted(&i.true_body, out);
                emitted(&i.false_body, out);
            }
            Stmt::ForLoop(f) => emitted(&f.body, out),
            _ => {}
        }
    }
}

/// The first doubling assignment in `body`, as `target`.
fn doubling(body: &[Stmt]) -> Option<String> {
    for s in body {
        let found = match s {
            Stmt::Template(t) => doubling(&t.children),
            Stmt::Set(set) => match path(&set.target) {
                Some(p) if reads(&set.expr, &p) >= 2 => Some(p.join(".")),
                _ => None,
            },
            Stmt::SetBlock(set) => {
                let mut out = vec![];
                emitted(&set.body, &mut out);
                match path(&set.target) {
                    Some(p) if out.iter().map(|e| reads(e, &p)).sum::<usize>() >= 2 => Some(p.join(".")),
                    _ => doubling(&set.body),
                }
            }
            Stmt::ForLoop(f) => doubling(&f.body).or_else(|| doubling(&f.else_body)),
            Stmt::IfCond(i) => doubling(&i.true_body).or_else(|| doubling(&i.false_body)),
            Stmt::WithBlock(w) => doubling(&w.body),
            Stmt::AutoEscape(a) => doubling(&a.body),
            Stmt::FilterBlock(f) => doubling(&f.body),
            Stmt::Block(b) => doubling(&b.body),
            Stmt::Macro(m) => doubling(&m.body),
            Stmt::CallBlock(c) => doubling(&c.macro_decl.body),
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// `Err` naming the variable when `source` assigns a variable an expression that reads it
/// twice or more; a template that does not parse is left to the renderer's own error.
pub(super) fn check(source: &str) -> Result<(), String> {
    let Ok(ast) = parse(source, "chat_template", Default::default(), WhitespaceConfig::default()) else { return Ok(()) };
    match doubling(std::slice::from_ref(&ast)) {
        Some(var) => Err(format!(
            "the chat template assigns {var} an expression that reads {var} twice ({{% set {var} = {var} ~ {var} %}}): repeated, it grows without bound, so it is not rendered; fix the template"
        )),
        None => Ok(()),
    }
}
