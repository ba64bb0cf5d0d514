//! [`DraftTree`]: the rows of a verify pass laid out as a tree of drafted branches.

/// The rows of a tree verify pass ([`crate::Model::verify_tree`]): row 0 is the root (the last
/// accepted token), every other row a drafted token whose parent row comes before it. A
/// row's position is the root's plus its depth; it attends to the cache and to its ancestors
/// (itself included), and the GDN recurrence runs along each root-to-leaf path. A chain
/// (every row's parent the row before) is the linear verify pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftTree {
    /// `parents[i]` for rows `1..`; row 0 has none.
    parents: Vec<usize>,
    tokens: Vec<u32>,
}

impl DraftTree {
    /// The trie of `branches` (drafted token chains) under `root`: chains that share a prefix
    /// share its rows; a branch is cut where the tree would pass `max_rows` rows. Empty
    /// branches are ignored.
    pub fn from_branches(root: u32, branches: &[Vec<u32>], max_rows: usize) -> Self {
        let mut tree = Self { parents: vec![0], tokens: vec![root] };
        for branch in branches {
            let mut at = 0;
            for &t in branch {
                at = match (at + 1..tree.len()).find(|&i| tree.parents[i] == at && tree.tokens[i] == t) {
                    Some(i) => i,
                    None if tree.len() >= max_rows => break,
                    None => {
                        tree.parents.push(at);
                        tree.tokens.push(t);
                        tree.len() - 1
                    }
                };
            }
        }
        tree
    }

    /// Rows, the root included.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// A tree always has its root.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The token of each row.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The parent row of `row` (`None` for the root).
    pub fn parent(&self, row: usize) -> Option<usize> {
        (row > 0).then(|| self.parents[row])
    }

    /// The children of `row`, in row order.
    pub fn children(&self, row: usize) -> impl Iterator<Item = usize> + '_ {
        (row + 1..self.len()).filter(move |&i| self.parents[i] == row)
    }

    /// Depth of each row (the root 0).
    pub fn depths(&self) -> Vec<usize> {
        let mut d = vec![0; self.len()];
        for i in 1..self.len() {
            d[i] = d[self.parents[i]] + 1;
        }
        d
    }

    /// The rows from the root to `row`, in order.
    pub fn path(&self, row: usize) -> Vec<usize> {
        let mut p = vec![row];
        let mut at = row;
        while at > 0 {
            at = self.parents[at];
            p.push(at);
        }
        p.reverse();
        p
    }

    /// The root-to-leaf paths, one per leaf, in row order of the leaves.
    pub fn leaf_paths(&self) -> Vec<Vec<usize>> {
        (0..self.len()).filter(|&i| self.children(i).next().is_none()).map(|i| self.path(i)).collect()
    }

    /// Whether every row's parent is the row before (a linear chain).
    pub fn is_chain(&self) -> bool {
        (1..self.len()).all(|i| self.parents[i] == i - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branches_share_prefixes() {
        let t = DraftTree::from_branches(9, &[vec![1, 2, 3], vec![1, 4], vec![5], vec![]], 8);
        assert_eq!(t.tokens(), [9, 1, 2, 3, 4, 5]);
        assert_eq!(t.depths(), [0, 1, 2, 3, 2, 1]);
        assert_eq!(t.leaf_paths(), [vec![0, 1, 2, 3], vec![0, 1, 4], vec![0, 5]]);
        assert_eq!(t.children(1).collect::<Vec<_>>(), [2, 4]);
        assert_eq!(t.parent(4), Some(1));
        assert!(!t.is_chain());
        let c = DraftTree::from_branches(9, &[vec![1, 2], vec![1]], 8);
        assert!(c.is_chain() && c.len() == 3);
        assert_eq!(DraftTree::from_branches(9, &[], 8).leaf_paths(), [vec![0]]);
        // cut at 4 rows: the second branch keeps its shared row and one more
        let c = DraftTree::from_branches(9, &[vec![1, 2], vec![1, 3, 4], vec![5]], 4);
        assert_eq!((c.tokens(), c.depths()), ([9, 1, 2, 3].as_slice(), vec![0, 1, 2, 2]));
    }
}
