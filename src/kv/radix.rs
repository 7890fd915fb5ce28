//! Radix tree over token ids whose nodes hold KV-pool slot indices (SGLang's RadixAttention
//! design, reference.md §6.1–6.5). It owns the prefix index only: which token runs have K/V in
//! which slots, reference-counted locks along node→root paths, LRU eviction of unlocked leaves
//! and the evictable/protected size accounting. It never touches K/V storage: slots that leave
//! the tree (duplicates on insert, evicted leaves, a flush) are handed back to the caller, who
//! returns them to the pool. Each tree lives in namespaces (e.g. a policy version or a
//! trajectory key); different namespaces never share nodes, so KV computed under one policy
//! version is never served under another. `flush` drops everything and refuses while a lock is
//! held (the synchronous trainer flushes at every weight update).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

/// Errors of the radix tree.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RadixError {
    /// `flush` was called while running sequences still hold locks.
    #[error("cannot flush the prefix cache: {locks} locks ({locked_tokens} cached tokens) are still held by running sequences")]
    LockedAtFlush {
        /// Locks still held.
        locks: usize,
        /// Cached tokens those locks protect.
        locked_tokens: usize,
    },
    /// `insert` was given a different number of slots than tokens.
    #[error(
        "insert of {tokens} tokens came with {slots} slots; every token needs exactly one slot"
    )]
    LengthMismatch {
        /// Tokens given.
        tokens: usize,
        /// Slots given.
        slots: usize,
    },
}

/// Handle on a tree node: the end of a matched or inserted prefix. Valid while the node is
/// locked, or until the next call that may evict (`evict`, `flush`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeRef(u32);

/// Result of [`RadixTree::match_prefix`]: the slots of the longest cached prefix and its end node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// KV-pool slots of the matched tokens, one per token (empty on a miss).
    pub slots: Vec<u32>,
    /// The node where the match ends (the namespace's root on a miss).
    pub node: NodeRef,
}

/// Result of [`RadixTree::insert`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inserted {
    /// Number of leading tokens that were already cached before this insert.
    pub prefix_len: usize,
    /// Caller slots the tree did not take because it already held those tokens in other slots;
    /// the caller frees them and uses `slots` from now on.
    pub duplicate_slots: Vec<u32>,
    /// The tree's slots for the whole inserted sequence.
    pub slots: Vec<u32>,
    /// Node at the end of the inserted sequence.
    pub node: NodeRef,
}

struct Node {
    parent: Option<u32>,
    children: HashMap<u32, u32>,
    key: Vec<u32>,
    slots: Vec<u32>,
    lock_ref: u32,
    last_access: u64,
}

/// The prefix cache index. See the module documentation.
#[derive(Default)]
pub struct RadixTree {
    nodes: Vec<Option<Node>>,
    free_ids: Vec<u32>,
    roots: BTreeMap<u64, u32>,
    clock: u64,
    evictable: usize,
    protected: usize,
    locks: usize,
}

impl RadixTree {
    /// An empty tree: no namespaces, nothing cached.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached tokens that no running sequence locks (what `evict` can free).
    pub fn evictable_size(&self) -> usize {
        self.evictable
    }

    /// Cached tokens on the path of at least one lock.
    pub fn protected_size(&self) -> usize {
        self.protected
    }

    /// All cached tokens (= slots owned by the tree).
    pub fn total_size(&self) -> usize {
        self.evictable + self.protected
    }

    /// Number of locks currently held.
    pub fn lock_count(&self) -> usize {
        self.locks
    }

    /// Number of non-root nodes.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().flatten().count() - self.roots.len()
    }

    /// Longest cached prefix of `tokens` in `namespace`. A match ending inside an edge splits
    /// that edge so that the returned node ends exactly at the match. Touches the path (LRU).
    pub fn match_prefix(&mut self, namespace: u64, tokens: &[u32]) -> PrefixMatch {
        let now = self.tick();
        let mut node = self.root(namespace);
        let mut slots = Vec::new();
        let mut pos = 0;
        while pos < tokens.len() {
            let Some(child) = self.node(node).children.get(&tokens[pos]).copied() else {
                break;
            };
            let common = common_prefix(&self.node(child).key, &tokens[pos..]);
            let child = if common < self.node(child).key.len() {
                self.split(child, common)
            } else {
                child
            };
            let n = self.node_mut(child);
            n.last_access = now;
            slots.extend_from_slice(&n.slots);
            pos += common;
            node = child;
        }
        PrefixMatch {
            slots,
            node: NodeRef(node),
        }
    }

    /// Caches `tokens` (whose K/V live in `slots`, one per token) in `namespace`. Tokens already
    /// cached keep the tree's slots; the caller's slots for them that differ are returned as
    /// duplicates. The new suffix becomes an unlocked leaf.
    pub fn insert(
        &mut self,
        namespace: u64,
        tokens: &[u32],
        slots: &[u32],
    ) -> Result<Inserted, RadixError> {
        if tokens.len() != slots.len() {
            return Err(RadixError::LengthMismatch {
                tokens: tokens.len(),
                slots: slots.len(),
            });
        }
        let matched = self.match_prefix(namespace, tokens);
        let prefix_len = matched.slots.len();
        let duplicate_slots = slots[..prefix_len]
            .iter()
            .zip(&matched.slots)
            .filter(|(mine, tree)| mine != tree)
            .map(|(mine, _)| *mine)
            .collect();
        let mut tree_slots = matched.slots;
        let mut node = matched.node.0;
        if prefix_len < tokens.len() {
            let now = self.clock;
            let leaf = self.add_node(Node {
                parent: Some(node),
                children: HashMap::new(),
                key: tokens[prefix_len..].to_vec(),
                slots: slots[prefix_len..].to_vec(),
                lock_ref: 0,
                last_access: now,
            });
            self.node_mut(node)
                .children
                .insert(tokens[prefix_len], leaf);
            self.evictable += tokens.len() - prefix_len;
            tree_slots.extend_from_slice(&slots[prefix_len..]);
            node = leaf;
        }
        Ok(Inserted {
            prefix_len,
            duplicate_slots,
            slots: tree_slots,
            node: NodeRef(node),
        })
    }

    /// Protects the path root→`node` from eviction (reference counted).
    pub fn lock(&mut self, node: NodeRef) {
        self.locks += 1;
        let mut cur = Some(node.0);
        while let Some(id) = cur.filter(|&id| !self.is_root(id)) {
            let n = self.node_mut(id);
            n.lock_ref += 1;
            let (len, first) = (n.key.len(), n.lock_ref == 1);
            cur = n.parent;
            if first {
                self.evictable -= len;
                self.protected += len;
            }
        }
    }

    /// Releases one lock taken with [`RadixTree::lock`] on the same node.
    pub fn unlock(&mut self, node: NodeRef) {
        assert!(self.locks > 0, "radix unlock without a matching lock");
        self.locks -= 1;
        let mut cur = Some(node.0);
        while let Some(id) = cur.filter(|&id| !self.is_root(id)) {
            let n = self.node_mut(id);
            assert!(n.lock_ref > 0, "radix unlock without a matching lock");
            n.lock_ref -= 1;
            let (len, last) = (n.key.len(), n.lock_ref == 0);
            cur = n.parent;
            if last {
                self.protected -= len;
                self.evictable += len;
            }
        }
    }

    /// Evicts unlocked leaves, least recently used first (a parent becomes a candidate once its
    /// last child is gone), until at least `min_tokens` slots are freed or nothing is evictable.
    /// Returns the freed slots.
    pub fn evict(&mut self, min_tokens: usize) -> Vec<u32> {
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .live_ids()
            .filter(|&id| self.is_evictable_leaf(id))
            .map(|id| Reverse((self.node(id).last_access, id)))
            .collect();
        let mut freed = Vec::new();
        while freed.len() < min_tokens {
            let Some(Reverse((_, id))) = heap.pop() else {
                break;
            };
            let node = self.remove_leaf(id);
            freed.extend_from_slice(&node.slots);
            let parent = node.parent.expect("a leaf always has a parent");
            if self.is_evictable_leaf(parent) {
                heap.push(Reverse((self.node(parent).last_access, parent)));
            }
        }
        freed
    }

    /// Drops every cached prefix in every namespace and returns all slots. Refuses while any
    /// lock is held, because a running sequence still reads those slots.
    pub fn flush(&mut self) -> Result<Vec<u32>, RadixError> {
        if self.locks > 0 {
            return Err(RadixError::LockedAtFlush {
                locks: self.locks,
                locked_tokens: self.protected,
            });
        }
        let slots = self
            .nodes
            .iter()
            .flatten()
            .flat_map(|n| n.slots.iter().copied())
            .collect();
        *self = Self::default();
        Ok(slots)
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn root(&mut self, namespace: u64) -> u32 {
        if let Some(&id) = self.roots.get(&namespace) {
            return id;
        }
        let id = self.add_node(Node {
            parent: None,
            children: HashMap::new(),
            key: Vec::new(),
            slots: Vec::new(),
            lock_ref: 0,
            last_access: 0,
        });
        self.roots.insert(namespace, id);
        id
    }

    fn is_root(&self, id: u32) -> bool {
        self.node(id).parent.is_none()
    }

    fn is_evictable_leaf(&self, id: u32) -> bool {
        let n = self.node(id);
        n.parent.is_some() && n.children.is_empty() && n.lock_ref == 0
    }

    fn node(&self, id: u32) -> &Node {
        self.nodes[id as usize]
            .as_ref()
            .expect("radix node handle refers to a removed node")
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        self.nodes[id as usize]
            .as_mut()
            .expect("radix node handle refers to a removed node")
    }

    fn live_ids(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nodes.len() as u32).filter(|&id| self.nodes[id as usize].is_some())
    }

    fn add_node(&mut self, node: Node) -> u32 {
        match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id as usize] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn remove_leaf(&mut self, id: u32) -> Node {
        let node = self.nodes[id as usize]
            .take()
            .expect("evicting a live node");
        self.free_ids.push(id);
        let parent = node.parent.expect("a leaf always has a parent");
        self.node_mut(parent).children.remove(&node.key[0]);
        self.evictable -= node.key.len();
        node
    }

    /// Splits `child`'s edge after `at` tokens: a new parent takes the first `at` tokens and
    /// slots and inherits the lock count; `child` keeps its id (so handles on it stay valid).
    fn split(&mut self, child: u32, at: usize) -> u32 {
        let c = self.node_mut(child);
        let tail_key = c.key.split_off(at);
        let tail_slots = c.slots.split_off(at);
        let head_key = std::mem::replace(&mut c.key, tail_key);
        let head_slots = std::mem::replace(&mut c.slots, tail_slots);
        let (parent, lock_ref, last_access) = (c.parent, c.lock_ref, c.last_access);
        let first_tail = c.key[0];
        let first_head = head_key[0];
        let mid = self.add_node(Node {
            parent,
            children: HashMap::from([(first_tail, child)]),
            key: head_key,
            slots: head_slots,
            lock_ref,
            last_access,
        });
        self.node_mut(child).parent = Some(mid);
        let parent = parent.expect("the root is never split");
        self.node_mut(parent).children.insert(first_head, mid);
        mid
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};

    #[test]
    fn match_splits_edges_and_insert_reports_duplicates() {
        let mut t = RadixTree::new();
        let ins = t.insert(0, &[1, 2, 3, 4], &[10, 11, 12, 13]).unwrap();
        assert_eq!(ins.prefix_len, 0);
        let m = t.match_prefix(0, &[1, 2, 9]);
        assert_eq!(m.slots, vec![10, 11]);
        assert_eq!(t.node_count(), 2, "the match split the edge");
        let ins = t.insert(0, &[1, 2, 7], &[10, 20, 21]).unwrap();
        assert_eq!(ins.prefix_len, 2);
        assert_eq!(ins.duplicate_slots, vec![20]);
        assert_eq!(ins.slots, vec![10, 11, 21]);
        assert_eq!(t.total_size(), 5);
    }

    #[test]
    fn locked_paths_survive_eviction_and_block_flush() {
        let mut t = RadixTree::new();
        let a = t.insert(0, &[1, 2, 3], &[0, 1, 2]).unwrap();
        t.insert(0, &[1, 2, 4], &[0, 1, 3]).unwrap();
        t.lock(a.node);
        assert_eq!((t.protected_size(), t.evictable_size()), (3, 1));
        assert_eq!(t.evict(10), vec![3]);
        assert_eq!(
            t.flush(),
            Err(RadixError::LockedAtFlush {
                locks: 1,
                locked_tokens: 3
            })
        );
        t.unlock(a.node);
        let mut all = t.flush().unwrap();
        all.sort();
        assert_eq!(all, vec![0, 1, 2]);
        assert_eq!(t.total_size(), 0);
    }

    #[test]
    fn eviction_is_lru_and_namespaces_never_share() {
        let mut t = RadixTree::new();
        t.insert(0, &[1, 1], &[0, 1]).unwrap();
        t.insert(0, &[2, 2], &[2, 3]).unwrap();
        t.match_prefix(0, &[1, 1]);
        assert_eq!(
            t.evict(1),
            vec![2, 3],
            "the least recently used leaf goes first"
        );
        assert!(
            t.match_prefix(7, &[1, 1]).slots.is_empty(),
            "another version sees nothing"
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert {
            ns: u64,
            seq: Vec<u32>,
            reuse: usize,
        },
        Match {
            ns: u64,
            seq: Vec<u32>,
        },
        Lock {
            ns: u64,
            seq: Vec<u32>,
        },
        Unlock(usize),
        Evict(usize),
        Flush,
    }

    fn op() -> impl Strategy<Value = Op> {
        let seq = || prop::collection::vec(0u32..3, 0..7);
        let ns = || 0u64..2;
        prop_oneof![
            4 => (ns(), seq(), 0usize..8).prop_map(|(ns, seq, reuse)| Op::Insert { ns, seq, reuse }),
            2 => (ns(), seq()).prop_map(|(ns, seq)| Op::Match { ns, seq }),
            2 => (ns(), seq()).prop_map(|(ns, seq)| Op::Lock { ns, seq }),
            2 => (0usize..4).prop_map(Op::Unlock),
            2 => (0usize..6).prop_map(Op::Evict),
            1 => Just(Op::Flush),
        ]
    }

    /// The naive model: one entry per cached (namespace, prefix) with the slot of its last token.
    #[derive(Default)]
    struct Naive {
        entries: HashMap<(u64, Vec<u32>), u32>,
        locks: Vec<(u64, Vec<u32>, Vec<u32>, NodeRef)>,
        free: Vec<u32>,
        next_slot: u32,
    }

    impl Naive {
        fn longest(&self, ns: u64, seq: &[u32]) -> Vec<u32> {
            (1..=seq.len())
                .map_while(|i| self.entries.get(&(ns, seq[..i].to_vec())).copied())
                .collect()
        }
        fn alloc(&mut self) -> u32 {
            self.free.pop().unwrap_or_else(|| {
                self.next_slot += 1;
                self.next_slot - 1
            })
        }
        fn is_locked(&self, ns: u64, prefix: &[u32]) -> bool {
            self.locks
                .iter()
                .any(|(lns, p, _, _)| *lns == ns && p.starts_with(prefix))
        }
        fn protected(&self) -> usize {
            self.entries
                .keys()
                .filter(|(ns, p)| self.is_locked(*ns, p))
                .count()
        }
    }

    fn apply(t: &mut RadixTree, m: &mut Naive, op: Op) {
        match op {
            Op::Insert { ns, seq, reuse } => {
                let cached = t.match_prefix(ns, &seq).slots;
                assert_eq!(cached, m.longest(ns, &seq), "match served wrong slots");
                let keep = reuse.min(cached.len());
                let mut mine = cached[..keep].to_vec();
                while mine.len() < seq.len() {
                    let s = m.alloc();
                    mine.push(s);
                }
                let ins = t.insert(ns, &seq, &mine).unwrap();
                assert_eq!(ins.prefix_len, cached.len());
                let expected_dups: Vec<u32> = mine[keep..cached.len()].to_vec();
                assert_eq!(ins.duplicate_slots, expected_dups);
                m.free.extend(ins.duplicate_slots);
                for i in cached.len()..seq.len() {
                    m.entries.insert((ns, seq[..=i].to_vec()), mine[i]);
                }
                assert_eq!(ins.slots, m.longest(ns, &seq));
            }
            Op::Match { ns, seq } => {
                assert_eq!(t.match_prefix(ns, &seq).slots, m.longest(ns, &seq));
            }
            Op::Lock { ns, seq } => {
                let got = t.match_prefix(ns, &seq);
                let prefix = seq[..got.slots.len()].to_vec();
                t.lock(got.node);
                m.locks.push((ns, prefix, got.slots, got.node));
            }
            Op::Unlock(i) => {
                if !m.locks.is_empty() {
                    let (ns, prefix, slots, node) = m.locks.remove(i % m.locks.len());
                    assert_eq!(m.longest(ns, &prefix), slots, "a locked path changed");
                    t.unlock(node);
                }
            }
            Op::Evict(n) => {
                let evictable = t.evictable_size();
                let freed = t.evict(n);
                assert!(freed.len() >= n.min(evictable));
                let freed_set: BTreeSet<u32> = freed.iter().copied().collect();
                assert_eq!(freed_set.len(), freed.len(), "a slot was freed twice");
                let gone: Vec<(u64, Vec<u32>)> = m
                    .entries
                    .iter()
                    .filter(|(_, s)| freed_set.contains(s))
                    .map(|(k, _)| k.clone())
                    .collect();
                assert_eq!(gone.len(), freed.len(), "freed a slot the tree did not own");
                for (ns, p) in &gone {
                    assert!(!m.is_locked(*ns, p), "freed a locked slot");
                    m.entries.remove(&(*ns, p.clone()));
                }
                for (ns, p) in m.entries.keys() {
                    let parent = (*ns, p[..p.len() - 1].to_vec());
                    assert!(
                        p.len() == 1 || m.entries.contains_key(&parent),
                        "evicted an inner node"
                    );
                }
                m.free.extend(freed);
            }
            Op::Flush => match t.flush() {
                Ok(mut slots) => {
                    assert!(m.locks.is_empty());
                    let mut expected: Vec<u32> = m.entries.values().copied().collect();
                    slots.sort();
                    expected.sort();
                    assert_eq!(slots, expected);
                    m.entries.clear();
                    m.free.extend(slots);
                }
                Err(RadixError::LockedAtFlush { .. }) => assert!(!m.locks.is_empty()),
                Err(e) => panic!("unexpected {e}"),
            },
        }
        assert_eq!(t.total_size(), m.entries.len());
        assert_eq!(t.protected_size(), m.protected());
        let distinct: BTreeSet<u32> = m.entries.values().copied().collect();
        assert_eq!(
            distinct.len(),
            m.entries.len(),
            "two cached tokens share a slot"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn tree_agrees_with_naive_model(ops in prop::collection::vec(op(), 1..60)) {
            let mut t = RadixTree::new();
            let mut m = Naive::default();
            for op in ops {
                apply(&mut t, &mut m, op);
            }
        }
    }
}
